"""agl-plugin-wandb: a run's metrics in Weights & Biases.

Enable it in a recipe (``plugins: {wandb: {project: my-project}}``) or with ``-p wandb``. The W&B run:

- gets every logged step's numeric metrics at that step (``run.log(metrics, step=step)``), the validation before
  training at step 0;
- has the resolved recipe as its config;
- is the agl_core run's own: its id is the run id (``<run_dir>/run.json``), so a run resumed with
  ``trainer.resume=auto`` continues the same W&B run (``resume="allow"``), and a new run (``resume: never``)
  starts a new one;
- holds each step once: the steps the run logs again after a resume (``ctx.purge_step`` on) that W&B already
  has from the process before (killed after its last checkpoint) are not sent again. W&B keeps a run's steps
  increasing and cannot take back a step; those steps are retrained from the same checkpoint with the same
  seeds, so what it holds for them is what the resumed run computed again (timings aside).
  ``<run_dir>/wandb.json`` records the last step sent;
- receives at the end ``agl plot``'s PNG of the run's curves as an artifact (type ``plot``) and as the
  summary's image ``curves`` (``plot: false`` turns it off).

Offline (``mode: offline``, or ``WANDB_MODE=offline``) the run is written under ``<dir>/wandb`` (``dir``: the
run directory unless set) and uploaded later with ``wandb sync``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from agl_core import HOOK_API_VERSION, hookimpl
from agl_core.builtin.trackers import chartable, curves_png

AGL_HOOK_API = HOOK_API_VERSION
NAME = "wandb"
PROGRESS_FILE = "wandb.json"

log = logging.getLogger("agl_plugin_wandb")


class WandbConfig(BaseModel):
    """The recipe section ``plugins.wandb``."""

    model_config = ConfigDict(extra="forbid")
    project: str = Field("agl_core", description="W&B project")
    entity: str | None = Field(None, description="W&B entity (user or team); default: your default entity")
    name: str | None = Field(None, description="display name of the run (default: the run directory's name)")
    group: str | None = Field(None, description="W&B group of the run")
    tags: list[str] = Field(default_factory=list, description="W&B tags of the run")
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="W&B mode (default: $WANDB_MODE, else online)")
    dir: str | None = Field(None, description="where W&B writes its files (<dir>/wandb); default: the run directory")
    plot: bool = Field(True, description="log agl plot's PNG of the curves at the end (artifact and summary image)")


class Tracker:
    """The W&B run of this agl_core run, and the last step it holds."""

    def __init__(self, run, progress: Path, last_step: int):
        self.run, self.progress, self.last_step = run, progress, last_step

    def log(self, metrics: dict, step: int) -> None:
        if step <= self.last_step:
            return  # W&B has this step from the process before this resume (see the module's docstring)
        self.run.log(chartable(metrics), step=step)
        self.last_step = step
        partial = self.progress.with_name(self.progress.name + ".partial")
        partial.write_text(json.dumps({"run_id": self.run.id, "last_step": step}))
        os.replace(partial, self.progress)


def last_step_sent(path: Path, run_id: str) -> int:
    """The last step this run's W&B run received, by ``path`` (-1: none, or a file of another run)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return -1
    return int(record.get("last_step", -1)) if record.get("run_id") == run_id else -1


@hookimpl
def plugin_config_schema():
    return WandbConfig


@hookimpl
def on_train_start(ctx):
    import wandb

    from agl_core.config import resolved

    cfg: WandbConfig = ctx.plugin_config(NAME)
    progress = ctx.run_dir / PROGRESS_FILE
    last = last_step_sent(progress, ctx.run_id)
    run = wandb.init(project=cfg.project, entity=cfg.entity, name=cfg.name or ctx.run_dir.resolve().name,
                     group=cfg.group, tags=cfg.tags or None, mode=cfg.mode, dir=str(cfg.dir or ctx.run_dir),
                     id=ctx.run_id, resume="allow", config=resolved(ctx.config), allow_val_change=True)
    if last >= ctx.purge_step:
        log.info("wandb: run %s already holds steps %d-%d from the process before this resume; they are not "
                 "sent again", run.id, ctx.purge_step, last)
    ctx.state[NAME] = Tracker(run, progress, last)


@hookimpl
def log_metrics(ctx, metrics, step):
    ctx.state[NAME].log(metrics, step)


@hookimpl
def on_train_end(ctx):
    tracker = ctx.state.pop(NAME, None)
    if tracker is None:
        return
    try:
        if ctx.plugin_config(NAME).plot:
            log_curves(tracker.run, ctx.run_dir)
    finally:
        tracker.run.finish()


def log_curves(run, run_dir: Path) -> None:
    """``agl plot``'s PNG of the run as an artifact and the summary's image ``curves``."""
    import wandb

    png = curves_png(run_dir, NAME)
    if png is None:
        return
    artifact = wandb.Artifact(f"curves-{run.id}", type="plot")
    artifact.add_file(str(png))
    run.log_artifact(artifact)
    run.summary["curves"] = wandb.Image(str(png))
