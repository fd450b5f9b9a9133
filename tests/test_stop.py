"""A signal asks the run to stop; the loop stops between steps, and a second signal stops at once.

In-process: the ``instant`` backend's trainer with :meth:`StopRequest.install`'s real
handlers, and a plugin that sends the signals to this very process from inside its
``log_metrics`` (a stand-in for a logger's critical section, where an exception raised
by the handler would once have landed: TensorBoard's writer queue, left broken).
"""

from __future__ import annotations

import os
import signal

import pytest

from agl_core import HOOK_API_VERSION, hookimpl
from agl_core.data import Task
from agl_core.loop import Trainer
from agl_core.stop import Interrupted

TASKS = [Task(id=f"t{i}", input={"prompt_ids": [i, i + 1]}) for i in range(4)]


class SignalsItself:
    """Sends ``signals`` SIGTERMs to its process in ``log_metrics`` of step ``at``; records what it got to."""

    AGL_HOOK_API = HOOK_API_VERSION

    def __init__(self, at: int, signals: int):
        self.at, self.signals = at, signals
        self.logged: list[int] = []
        self.hook_ended: list[int] = []
        self.train_ended = False

    @hookimpl
    def log_metrics(self, metrics, step):
        self.logged.append(step)
        if step == self.at:
            for _ in range(self.signals):
                os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next bytecode
        self.hook_ended.append(step)

    @hookimpl
    def on_train_end(self):
        self.train_ended = True


@pytest.fixture
def restore_handlers():
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def train(make_recipe, plugin) -> Trainer:
    recipe, pset = make_recipe(["data.train_batch_size=4", "rollout.n=2", "algorithm.ppo_mini_batch_size=4",
                                "trainer.val_before_train=false", "trainer.total_steps=50"],
                               plugins=[("signals", plugin)], flags=["instant"])
    trainer = Trainer(recipe, pset, train_tasks=TASKS, val_tasks=[])
    trainer.stop.install()
    return trainer


def test_a_signal_stops_the_run_after_the_running_step_not_inside_a_hook(make_recipe, restore_handlers, capfd):
    plugin = SignalsItself(at=3, signals=1)
    trainer = train(make_recipe, plugin)
    with pytest.raises(Interrupted) as raised:
        trainer.fit()
    assert raised.value.signum == signal.SIGTERM
    assert plugin.hook_ended == plugin.logged == [1, 2, 3]  # the hook ran to its end; no step 4 began
    assert trainer.ctx.step == 3 and plugin.train_ended
    assert "agl: SIGTERM: stopping after the running step" in capfd.readouterr().err


def test_a_second_signal_stops_at_once(make_recipe, restore_handlers):
    plugin = SignalsItself(at=2, signals=2)
    trainer = train(make_recipe, plugin)
    with pytest.raises(Interrupted):
        trainer.fit()
    assert plugin.logged == [1, 2] and plugin.hook_ended == [1]  # raised inside the hook, as asked
    assert plugin.train_ended
