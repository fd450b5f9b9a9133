"""The store and gateway services the plugin starts on the head node: ``agl serve …`` child processes.

A service prints its URL on stdout once it serves; its output goes to a log
file in the run directory, which is also where a failed start is explained.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

POLL_S = 0.05
LOG_TAIL_CHARS = 3000
STOP_TIMEOUT_S = 10.0


@dataclass
class Service:
    """A running ``agl serve`` process: where it answers and how to stop it."""

    name: str
    url: str
    process: subprocess.Popen
    log: Path

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited within ``STOP_TIMEOUT_S``."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def agl_argv(*args: str) -> list[str]:
    """``agl ARGS`` on the console script of this interpreter's environment."""
    exe = Path(sys.executable).with_name("agl")
    return [str(exe) if exe.exists() else shutil.which("agl") or "agl", *args]


def start(name: str, args: list[str], log: Path, env: dict[str, str], timeout_s: float) -> Service:
    """Start ``agl serve ARGS`` with ``env`` added to ours; return once it printed its URL.

    Raises RuntimeError naming the service and quoting its log when it exits
    first or prints nothing within ``timeout_s`` (the process is then stopped).
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:  # the child keeps its own descriptor
        process = subprocess.Popen(agl_argv("serve", *args), stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env={**os.environ, **env})
    deadline = time.monotonic() + timeout_s
    while True:
        url = _printed_url(log)
        if url is not None:
            return Service(name, url, process, log)
        if process.poll() is not None:
            raise RuntimeError(f"the {name} service (agl serve {' '.join(args)}) exited with status "
                               f"{process.returncode} before serving; its log {log} ends:\n{_tail(log)}")
        if time.monotonic() > deadline:
            Service(name, "", process, log).stop()
            raise RuntimeError(f"the {name} service (agl serve {' '.join(args)}) printed no URL within "
                               f"plugins.ray.start_timeout_s={timeout_s:g} s; its log {log} ends:\n{_tail(log)}")
        time.sleep(POLL_S)


def _printed_url(log: Path) -> str | None:
    for line in log.read_text(errors="replace").splitlines(keepends=True):
        if line.startswith(("http://", "https://")) and line.endswith("\n"):  # a whole line, not half written
            return line.strip()
    return None


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-LOG_TAIL_CHARS:]
