"""Memory figures of this process from Linux's ``/proc``: the resident set and its high-water mark.

Imported by the benchmarks that report memory (they run as scripts from
this directory, which puts it on ``sys.path``).
"""

from __future__ import annotations

from pathlib import Path


def status_bytes(field: str, pid: int | str = "self") -> int:
    """A memory field of a process (this one by default) from ``/proc/PID/status`` (``VmRSS``, ``VmHWM``), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(f"no {field} in /proc/{pid}/status")


def reset_peak() -> None:
    """Make ``VmHWM`` restart from the current resident set (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")
