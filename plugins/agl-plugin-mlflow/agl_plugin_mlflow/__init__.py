"""agl-plugin-mlflow: a run's metrics in MLflow.

Enable it in a recipe (``plugins: {mlflow: {experiment: my-experiment}}``) or with ``-p mlflow``. The MLflow run:

- gets every logged step's numeric metrics at that step, the validation before training at step 0;
- has the resolved recipe as params (flattened keys, ``trainer.total_steps``) and as the artifact
  ``config.yaml``;
- is the agl_core run's own: it carries the tag ``agl.run_id`` (the id in ``<run_dir>/run.json``), so a run
  resumed with ``trainer.resume=auto`` finds it and continues it, and a new run (``resume: never``) starts a
  new one. Params are MLflow's immutable record of how the run started: a resumed run keeps them and logs
  its own recipe as ``config.yaml`` again;
- holds each step once: the tag ``agl.last_step`` says the last step the run received; steps a resumed run
  logs again (``ctx.purge_step`` on) that MLflow already has from the process before (killed after its last
  checkpoint) are not sent again. They are retrained from the same checkpoint with the same seeds, so what
  MLflow holds for them is what the resumed run computed again (timings aside);
- receives at the end ``agl plot``'s PNG of the run's curves as the artifact ``curves.png`` (``plot: false``
  turns it off), and ends ``FINISHED``.

``tracking_uri`` is MLflow's: a server (``http://host:5000``), a local file store (``file:/path/mlruns``),
or unset for ``$MLFLOW_TRACKING_URI`` and else MLflow's default.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from agl_core import HOOK_API_VERSION, hookimpl
from agl_core.builtin.trackers import chartable, curves_png

AGL_HOOK_API = HOOK_API_VERSION
NAME = "mlflow"
RUN_TAG = "agl.run_id"
LAST_STEP_TAG = "agl.last_step"
MAX_PARAM_VALUE = 500  # the length every MLflow version accepts (newer ones take 6000)
BATCH = 100  # params per log_batch call: MLflow's limit

log = logging.getLogger("agl_plugin_mlflow")


class MlflowConfig(BaseModel):
    """The recipe section ``plugins.mlflow``."""

    model_config = ConfigDict(extra="forbid")
    tracking_uri: str | None = Field(None, description="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else "
                                                       "MLflow's default)")
    experiment: str = Field("agl_core", description="MLflow experiment (created if missing)")
    run_name: str | None = Field(None, description="name of the run (default: the run directory's name)")
    tags: dict[str, str] = Field(default_factory=dict, description="more tags of the run")
    plot: bool = Field(True, description="log agl plot's PNG of the curves at the end as an artifact")


class Tracker:
    """The MLflow run of this agl_core run, and the last step it holds."""

    def __init__(self, client, run_id: str, last_step: int):
        self.client, self.run_id, self.last_step = client, run_id, last_step

    def log(self, metrics: dict, step: int) -> None:
        from mlflow.entities import Metric, RunTag

        if step <= self.last_step:
            return  # MLflow has this step from the process before this resume (see the module's docstring)
        now = int(time.time() * 1000)
        values = [Metric(key, value, now, step) for key, value in chartable(metrics).items()]
        # The step's metrics and the tag that says they are there, in one request.
        self.client.log_batch(self.run_id, metrics=values, tags=[RunTag(LAST_STEP_TAG, str(step))])
        self.last_step = step


def flatten(section: Any, prefix: str = "") -> dict[str, str]:
    """``{"trainer.total_steps": "30", ...}``: the recipe's leaves as MLflow params (lists as JSON)."""
    if isinstance(section, dict):
        out: dict[str, str] = {}
        for key, value in section.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    text = json.dumps(section) if isinstance(section, list | tuple) else str(section)
    return {prefix[:-1]: text if len(text) <= MAX_PARAM_VALUE else text[:MAX_PARAM_VALUE - 3] + "..."}


@hookimpl
def plugin_config_schema():
    return MlflowConfig


@hookimpl
def on_train_start(ctx):
    from mlflow.entities import Param, RunTag
    from mlflow.tracking import MlflowClient

    from agl_core.config import resolved

    cfg: MlflowConfig = ctx.plugin_config(NAME)
    client = MlflowClient(tracking_uri=cfg.tracking_uri)
    experiment = client.get_experiment_by_name(cfg.experiment)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(cfg.experiment)
    found = client.search_runs([experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{ctx.run_id}'",
                               max_results=1) if ctx.run_id else []
    if found:
        run = found[0]
        client.update_run(run.info.run_id, status="RUNNING")
        last = int(run.data.tags.get(LAST_STEP_TAG, -1))
        if last >= ctx.purge_step:
            log.info("mlflow: run %s already holds steps %d-%d from the process before this resume; they are "
                     "not sent again", run.info.run_id, ctx.purge_step, last)
    else:
        tags = {RUN_TAG: ctx.run_id or "", "agl.run_dir": str(ctx.run_dir.resolve()), **cfg.tags}
        run = client.create_run(experiment_id, run_name=cfg.run_name or ctx.run_dir.resolve().name, tags=tags)
        params = [Param(k, v) for k, v in flatten(resolved(ctx.config)).items()]
        for start in range(0, len(params), BATCH):
            client.log_batch(run.info.run_id, params=params[start:start + BATCH])
        last = -1
    config = ctx.run_dir / "config.yaml"
    if config.is_file():  # written by the trainer before on_train_start (not by a bare contract test)
        client.log_artifact(run.info.run_id, str(config))
    ctx.state[NAME] = Tracker(client, run.info.run_id, last)


@hookimpl
def log_metrics(ctx, metrics, step):
    ctx.state[NAME].log(metrics, step)


@hookimpl
def on_train_end(ctx):
    tracker = ctx.state.pop(NAME, None)
    if tracker is None:
        return
    try:
        png = curves_png(ctx.run_dir, NAME) if ctx.plugin_config(NAME).plot else None
        if png is not None:
            tracker.client.log_artifact(tracker.run_id, str(png))
    finally:
        tracker.client.set_terminated(tracker.run_id)
