"""Where checkpoints live and the core's own part of them.

A checkpoint is the directory ``<run_dir>/checkpoints/global_step_<N>``. Every
plugin writes its state into it through the ``save_checkpoint`` hook; the core
adds ``core_state.pt`` (step, data position, RNG, KL coefficient) and
``plugins.json`` (the active plugin set). It is written under a temporary name
and renamed when complete, so a crash never leaves a half checkpoint that
``resume=auto`` would pick.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

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
