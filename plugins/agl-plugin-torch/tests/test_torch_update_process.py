"""Training in an update process (asynchronous training on a CPU): a real spawned process over shared weights.

Covered: log-probs, actor and critic updates made in the process equal those
made in the trainer's process from the same start, bit for bit, and land in
the trainer's own tensors; a checkpoint saved with the process holds its
optimizers' states and resumes into another; an error in the process is
raised in the caller with the process's traceback; a policy loss that cannot
be sent, and a process that died, are named; a process that cannot start
says so at the first call (the start is not waited for: it overlaps the first
batch); the process runs at a lower scheduling priority.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from agl_core.builtin.estimators import vanilla_policy_loss

from agl_plugin_torch.backend import create
from agl_plugin_torch.settings import TorchConfig
from agl_plugin_torch.testing import algorithm, sampled_rows, tiny_section
from agl_plugin_torch.worker_process import WorkerProcessError


def made(tmp_path, with_critic=False):
    config = TorchConfig.model_validate(tiny_section(critic={"lr": 0.01}))
    return create(config, tmp_path / "run", seed=0, with_critic=with_critic)


@pytest.fixture
def pair(tmp_path):
    """Two backends with the same initial weights; the second trains in a process of its own."""
    here, there = made(tmp_path, with_critic=True), made(tmp_path, with_critic=True)
    there.train_in_a_process()
    yield here, there
    there.stop_serving()


def rows_to_train(backend):
    batch = sampled_rows(backend)
    batch["advantages"] = torch.randn(len(batch), 1, generator=torch.Generator().manual_seed(1)) \
        * batch["response_mask"]
    batch["returns"] = 0.8 * batch["response_mask"]
    return batch


def test_updates_in_the_process_equal_those_in_the_trainers_process_and_land_in_its_weights(pair):
    here, there = pair
    batch = rows_to_train(here)
    before = [p.clone() for p in there.actor.parameters()]
    for _ in range(2):
        metrics = [backend.run("update_actor", batch, algorithm(ppo_epochs=2), vanilla_policy_loss)
                   for backend in (here, there)]
        assert metrics[0] == metrics[1]
    for mine, theirs, initial in zip(here.actor.parameters(), there.actor.parameters(), before):
        assert torch.equal(mine, theirs) and not torch.equal(theirs, initial)
    torch.testing.assert_close(there.run("old_logprobs", batch), here.run("old_logprobs", batch), rtol=0, atol=0)
    torch.testing.assert_close(there.run("ref_logprobs", batch), here.run("ref_logprobs", batch), rtol=0, atol=0)

    batch["values"] = here.run("values", batch)
    assert (here.run("update_critic", batch, algorithm()) == there.run("update_critic", batch, algorithm()))
    for mine, theirs in zip(here.critic.parameters(), there.critic.parameters()):
        assert torch.equal(mine, theirs)


def test_a_checkpoint_holds_the_process_optimizers_and_resumes_into_another(pair, tmp_path):
    here, there = pair
    batch = rows_to_train(here)
    there.run("update_actor", batch, algorithm(), vanilla_policy_loss)
    there.save(tmp_path / "ckpt")
    assert there.run("optimizer_states")["actor_optim"]["state"]  # Adam's moments were made in the process

    resumed = made(tmp_path / "resumed", with_critic=True)
    resumed.load(tmp_path / "ckpt")
    resumed.train_in_a_process()
    try:
        metrics = [b.run("update_actor", batch, algorithm(), vanilla_policy_loss) for b in (there, resumed)]
        assert metrics[0] == metrics[1]
        for a, b in zip(there.actor.parameters(), resumed.actor.parameters()):
            assert torch.equal(a, b)
    finally:
        resumed.stop_serving()


def test_an_error_in_the_process_is_raised_in_the_caller_and_the_process_serves_on(pair):
    _, there = pair
    batch = rows_to_train(there)
    batch.pop("advantages")
    with pytest.raises(WorkerProcessError, match=r"failed in 'update_actor'(.|\n)*advantages"):
        there.run("update_actor", batch, algorithm(), vanilla_policy_loss)
    assert there.run("old_logprobs", batch)[0].shape == batch["responses"].shape


def test_a_policy_loss_that_cannot_be_sent_is_named(pair):
    _, there = pair

    def local_loss(*args, **kwargs):  # a local function pickles by name, which the process cannot import
        return vanilla_policy_loss(*args, **kwargs)

    with pytest.raises(WorkerProcessError, match=r"cannot send 'update_actor'.*local_loss.*module-level function"):
        there.run("update_actor", rows_to_train(there), algorithm(), local_loss)


def test_a_process_that_died_is_named(pair):
    _, there = pair
    os.kill(there.update_process.pid, signal.SIGKILL)  # it runs no more code: the call finds it dead
    with pytest.raises(WorkerProcessError, match=r"died during 'old_logprobs' \(exit code -9\)"):
        there.run("old_logprobs", rows_to_train(there))


def test_a_process_that_cannot_start_says_so_at_the_first_call(tmp_path, monkeypatch):
    backend = made(tmp_path)
    # Optimizer states without param_groups: the process fails to load them while starting.
    monkeypatch.setattr(backend, "optimizer_states", lambda: {"actor_optim": {"state": {}}})
    backend.train_in_a_process()
    try:
        with pytest.raises(WorkerProcessError, match=r"failed in 'old_logprobs':\nwhile starting:(.|\n)*param_groups"):
            backend.run("old_logprobs", rows_to_train(backend))
    finally:
        backend.stop_serving()


def test_the_process_runs_at_the_configured_lower_priority(pair):
    """The rollout plane gets the cores first (``update_process_nice``, 10 by default)."""
    _, there = pair
    there.run("optimizer_states")  # the process has started: it lowers its priority first
    assert there.config.update_process_nice == 10
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    assert os.getpriority(os.PRIO_PROCESS, there.update_process.pid) == min(19, mine + 10)
