"""Built-in plugin ``tensorboard``: every logged metric as a TensorBoard scalar in ``<run_dir>/tensorboard``.

Active in every run, like the JSONL logger; a recipe turns it off with
``plugins: {disable: [tensorboard]}`` (or ``-p no:tensorboard``). The writer
is opened at the first logged step, so a run that logs nothing writes
nothing. View with ``tensorboard --logdir <run_dir>/tensorboard``.

Each step appears once: the writer opens with ``purge_step`` at the first
step this run logs, so TensorBoard drops what an earlier, killed process of
the run logged from that step on.
"""

from __future__ import annotations

from agl_core import HOOK_API_VERSION, hookimpl
from agl_core.builtin.trackers import chartable

AGL_HOOK_API = HOOK_API_VERSION
NAME = "tensorboard"
DIRNAME = "tensorboard"
PURGE = NAME + ".purge_step"


def writer_of(ctx):
    """The run's ``SummaryWriter``, opened on first use."""
    if NAME not in ctx.state:
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only runs that log pay for it

        ctx.state[NAME] = SummaryWriter(log_dir=str(ctx.run_dir / DIRNAME), purge_step=ctx.state.get(PURGE))
    return ctx.state[NAME]


@hookimpl
def on_train_start(ctx):
    # Kept for the writer: by the first logged step ctx.step has moved on.
    ctx.state[PURGE] = ctx.purge_step


@hookimpl
def log_metrics(ctx, metrics, step):
    writer = writer_of(ctx)
    # TensorBoard draws NaN/inf as gaps at best; JSONL keeps them as null
    for key, value in chartable(metrics).items():
        writer.add_scalar(key, value, step)
    writer.flush()  # a killed run keeps every step it logged, as with the JSONL file


@hookimpl
def on_train_end(ctx):
    ctx.state.pop(PURGE, None)
    writer = ctx.state.pop(NAME, None)
    if writer is not None:
        writer.close()
