"""A run directory: owned by one live trainer, named by a run id, started over only on request.

A trainer holds an exclusive ``flock`` on ``<run_dir>/.agl.lock`` for the
whole run (:func:`claim`). The kernel drops the lock when the process dies,
``kill -9`` included, so a lock left by a dead trainer is simply free: the
next trainer takes it and says so. The file's content (host, pid, start time
of the holder) only serves the messages; a clean exit empties it.

``run.json`` names the run with a random id, written when the directory
first becomes a run directory (:func:`prepare`). Every checkpoint records
that id, so ``resume=auto`` can tell this run's checkpoints from another's.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import Iterator

from agl_core.config import ConfigError

log = logging.getLogger("agl_core")

LOCK = ".agl.lock"
RUN_FILE = "run.json"
# What makes a directory a run directory; config.yaml alone: one written before run ids existed.
MARKERS = (RUN_FILE, "config.yaml")


@contextlib.contextmanager
def claim(run_dir: Path) -> Iterator[None]:
    """Own ``run_dir`` (created if missing) for the block; release it after, also on errors.

    Raises :class:`ConfigError` when a live trainer holds it (naming that
    trainer's pid, host and start time), when it is a directory that holds
    files but is no run directory (nothing is written into it then), or when
    it cannot be created or written (naming the path).
    """
    fd = _open_lock(run_dir)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"run directory {run_dir} is in use by {_describe(_read(fd))}; "
                              f"wait for it to end or choose another trainer.run_dir") from None
        stale = _read(fd)
        if stale:
            log.warning("run directory %s: took over the stale lock of %s, which is no longer running",
                        run_dir, _describe(stale))
        _write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                               "since": time.strftime("%Y-%m-%d %H:%M:%S %z")}))
        try:
            yield
        finally:
            _write(fd, "")  # released cleanly: the next trainer has nothing stale to report
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def prepare(run_dir: Path, fresh: bool, overwrite: bool) -> str:
    """Make the claimed ``run_dir`` ready for a run and return its run id.

    ``fresh`` (``resume: never``): a directory that holds anything is refused,
    unless ``overwrite`` is set and it is a run directory (see :data:`MARKERS`):
    then its contents are deleted and a new run begins. A directory with no
    ``run.json`` gets one with a new id.
    """
    held = sorted(p for p in run_dir.iterdir() if p.name != LOCK)
    if fresh and held:
        if not _is_run_dir(run_dir):
            raise _not_a_run_dir(run_dir)
        if not overwrite:
            raise ConfigError(f"trainer.run_dir: {run_dir} holds a previous run and trainer.resume is 'never'; "
                              f"continue it with trainer.resume=auto, or delete it and start over with "
                              f"trainer.overwrite=true")
        for path in held:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        log.info("trainer.overwrite: deleted the previous run in %s", run_dir)
    run_id = read_run_id(run_dir)
    if run_id is None:
        run_id = uuid.uuid4().hex
        created = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        (run_dir / RUN_FILE).write_text(json.dumps({"run_id": run_id, "created": created}, indent=2) + "\n")
    return run_id


def read_run_id(run_dir: Path) -> str | None:
    """The id in ``run_dir/run.json``, or None when the directory has none."""
    try:
        return json.loads((run_dir / RUN_FILE).read_text())["run_id"]
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"trainer.run_dir: {run_dir / RUN_FILE} is damaged (no run_id); "
                          f"restore it, or start over with trainer.resume=never trainer.overwrite=true") from None


def _is_run_dir(run_dir: Path) -> bool:
    return any((run_dir / marker).exists() for marker in MARKERS)


def _not_a_run_dir(run_dir: Path) -> ConfigError:
    return ConfigError(f"trainer.run_dir: {run_dir} is not empty and is not a run directory "
                       f"(it has no {' or '.join(MARKERS)}); choose an empty or new directory")


def _open_lock(run_dir: Path) -> int:
    try:
        if run_dir.is_dir() and not (run_dir / LOCK).exists() and not _is_run_dir(run_dir) \
                and any(run_dir.iterdir()):
            raise _not_a_run_dir(run_dir)  # not even a lock file goes into a directory that is someone else's
        run_dir.mkdir(parents=True, exist_ok=True)
        return os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename and Path(exc.filename) != run_dir else ""
        raise ConfigError(f"trainer.run_dir: cannot write the run directory {run_dir}: "
                          f"{exc.strerror or exc}{where}") from None


def _read(fd: int) -> dict:
    """The holder recorded in the lock file; empty when there is none (or it is half written)."""
    text = os.pread(fd, 4096, 0).decode(errors="replace")
    try:
        holder = json.loads(text) if text.strip() else {}
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def _write(fd: int, text: str) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, text.encode(), 0)


def _describe(holder: dict) -> str:
    if not holder:
        return "another trainer"
    return f"the trainer pid {holder.get('pid')} on host {holder.get('host')} since {holder.get('since')}"
