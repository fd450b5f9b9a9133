"""Where checkpoints live and the core's own part of them.

A checkpoint is the directory ``<run_dir>/checkpoints/global_step_<N>``. Every
plugin writes its state into it through the ``save_checkpoint`` hook; the core
adds ``core_state.pt`` (step, data position, RNG, KL coefficient, the run id)
and ``plugins.json`` (the active plugin set). It is written under a temporary
name and renamed when complete, so a crash never leaves a half checkpoint that
``resume=auto`` would pick.

``resume=auto`` loads only a checkpoint of the run directory's own run id. A
checkpoint written before checkpoints carried a run id is taken as its run
directory's own, with a warning: nothing else can be known about it, and
since ``resume: never`` no longer writes into a directory that holds a run,
new mixes cannot arise.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from agl_core.config import ConfigError

log = logging.getLogger("agl_core")

CORE_STATE = "core_state.pt"
MANIFEST = "plugins.json"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The complete checkpoint with the highest step, or None."""
    found = [
        (int(m.group(1)), p)
        for p in checkpoints_dir(run_dir).glob("global_step_*")
        if (m := _STEP_DIR.match(p.name)) and (p / CORE_STATE).exists()
    ]
    return max(found)[1] if found else None


def locate(path: Path) -> tuple[Path, Path | None]:
    """``(run_dir, checkpoint)`` of ``path``, a checkpoint or a run directory (then its latest checkpoint, or None)."""
    path = Path(path)
    if (path / CORE_STATE).is_file():
        return path.parent.parent, path  # <run_dir>/checkpoints/global_step_<N>
    return path, latest_checkpoint(path)


def to_resume(run_dir: Path, resume: str, run_id: str | None) -> Path | None:
    """The checkpoint ``trainer.resume`` asks for in run ``run_id`` of ``run_dir``; None: start at step 0.

    ``never``: None. ``auto``: the latest complete checkpoint of ``run_dir``, or
    None; one of another run id is an error naming both ids. Anything else is
    the path of a checkpoint, or of a run directory (its latest checkpoint);
    it must exist, and may belong to another run (fine-tuning from it).
    Reads only; every problem is a :class:`ConfigError` naming ``trainer.resume``.
    """
    if resume == "never":
        return None
    if resume == "auto":
        path = latest_checkpoint(run_dir)
        if path is None:
            return None
        theirs = run_id_of(path)
        if theirs is None:
            log.warning("checkpoint %s was written before checkpoints carried a run id; "
                        "resuming from it as a checkpoint of this run directory", path)
        elif run_id is not None and theirs != run_id:
            raise ConfigError(f"trainer.resume: the latest checkpoint {path} belongs to run {theirs}, but "
                              f"{run_dir} is run {run_id}; resume from it on purpose with trainer.resume={path}, "
                              f"or remove it")
        return path
    given = Path(resume)
    if not given.exists():
        near = difflib.get_close_matches(resume, ["auto", "never"], n=1, cutoff=0.6)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ConfigError(f"trainer.resume: {resume!r} is neither 'auto', 'never' nor an existing checkpoint "
                          f"or run directory{hint}")
    _, path = locate(given)
    if path is None:
        raise ConfigError(f"trainer.resume: {given} is neither a checkpoint (no {CORE_STATE}) nor a run "
                          f"directory holding one")
    theirs = run_id_of(path)
    if theirs != run_id:
        log.info("resuming from %s, a checkpoint of another run (%s), into run %s",
                 path, theirs or "of unknown id", run_id or "new")
    return path


def run_id_of(path: Path) -> str | None:
    """The run id the checkpoint at ``path`` records (None: written before checkpoints carried one)."""
    return torch.load(path / CORE_STATE, weights_only=False).get("run_id")


def save(run_dir: Path, step: int, core_state: dict[str, Any], manifest: list[dict],
         write_plugins: Callable[[str], None]) -> Path:
    """Write checkpoint ``step``: plugins first, then the core state, then an atomic rename."""
    final = checkpoints_dir(run_dir) / f"global_step_{step}"
    partial = final.with_name(final.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    write_plugins(str(partial))
    state = {**core_state, "step": step, "rng": _rng_state()}
    torch.save(state, partial / CORE_STATE)
    (partial / MANIFEST).write_text(json.dumps(manifest, indent=2))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(partial, final)
    return final


def load(path: Path) -> dict[str, Any]:
    """Read the core state of the checkpoint at ``path`` and restore the global RNGs."""
    if not (path / CORE_STATE).exists():
        raise FileNotFoundError(f"{path} is not a checkpoint (no {CORE_STATE})")
    state = torch.load(path / CORE_STATE, weights_only=False)
    _set_rng_state(state["rng"])
    return state


def _rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
