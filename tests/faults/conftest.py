"""Shared pieces of the fault suite: the ``agl`` command as a real subprocess, and a quickstart run directory.

Every fault test uses real processes, real files and real HTTP on 127.0.0.1,
and is bounded in count and time (each subprocess has a timeout).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart" / "recipe.yaml"
GUESS_NUMBER = ROOT / "examples" / "guess_number" / "recipe.yaml"


def agl_command(*args) -> list[str]:
    """The argv of ``agl ARGS`` on the installed console script."""
    exe = shutil.which("agl") or str(Path(sys.executable).with_name("agl"))
    return [exe, *map(str, args)]


def run_agl(*args, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``agl ARGS`` in the repository root and wait for it (at most ``timeout`` seconds)."""
    return subprocess.run(agl_command(*args), capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})}, timeout=timeout)


def spawn_agl(*args, env: dict[str, str] | None = None, log: Path | None = None) -> subprocess.Popen:
    """Start ``agl ARGS`` in the repository root without waiting; output goes to ``log`` (or is discarded).

    The child takes SIGINT as one started from a terminal does, also when the test run was started in the
    background by a script, whose shell has its children ignore SIGINT (Python then keeps ignoring it).
    """
    out = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115 - the child owns it
    return subprocess.Popen(agl_command(*args), stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, **(env or {})},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """A run directory that does not exist yet."""
    return tmp_path / "run"


def wait_until(condition: Callable[[], object], timeout: float, what: str) -> object:
    """Poll ``condition`` every 10 ms until it returns something true (returned); fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)
    return result


@pytest.fixture
def agl() -> SimpleNamespace:
    """This module's helpers for test modules, which cannot import it by name (the repository has several
    ``conftest`` modules): ``agl.run``, ``agl.spawn``, ``agl.wait_until``, ``agl.QUICKSTART``, ``agl.GUESS_NUMBER``."""
    return SimpleNamespace(run=run_agl, spawn=spawn_agl, wait_until=wait_until, QUICKSTART=QUICKSTART,
                           GUESS_NUMBER=GUESS_NUMBER)
