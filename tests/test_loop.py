"""The trainer loop, end to end through every hook, on the instant backend (agl-plugin-instant).

The instant backend is a real installed plugin distribution whose "model" is a
row of logits (no language model); every other part of the step is real.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from agl_core import HOOK_API_VERSION, hookimpl
from agl_core.checkpoint import CORE_STATE
from agl_core.config import ConfigError
from agl_core.data import Task
from agl_core.loop import Trainer
from agl_core.testing import BatchRecorder

TASKS = [Task(id="long", input={"prompt_ids": list(range(20))})] + [
    Task(id=f"t{i}", input={"prompt_ids": [i, i + 1]}) for i in range(5)
]
VAL = [Task(id=f"v{i}", input={"prompt_ids": [i]}) for i in range(3)]


def trainer(make_recipe, overrides, tasks=TASKS, val=VAL, recorder=None, batch_size=6, flags=("instant",)):
    base = ["plugins.instant.world_size=2", f"data.train_batch_size={batch_size}", "data.max_prompt_length=8",
            "data.max_response_length=4", "rollout.n=4", "algorithm.ppo_mini_batch_size=8",
            "trainer.val_before_train=false"]
    plugins = [("recorder", recorder)] if recorder else []
    recipe, pset = make_recipe(base + list(overrides), plugins=plugins, flags=list(flags))
    return Trainer(recipe, pset, train_tasks=tasks, val_tasks=val)


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_one_step_through_every_hook_with_drop_floor_and_pad(make_recipe):
    recorder = BatchRecorder()
    # Rollouts are numbered 1..24; every 7th fails: 21 rows. The 4 rows of "long" have
    # a 21-token prompt (> 8): dropped. 17 rows floor to 16 (mini-batch 8).
    t = trainer(make_recipe, ["plugins.instant.fail_every=7", "algorithm.use_kl_in_reward=true",
                              "algorithm.policy_loss.use_kl_loss=true", "trainer.total_steps=1",
                              "trainer.test_freq=1", "trainer.save_freq=1"], recorder=recorder)
    metrics = t.fit()
    state = t.ctx.state["instant"]
    for hook in ("on_train_start", "on_step_start", "collect_rollouts:train", "post_process_batch",
                 "compute_old_logprob", "compute_ref_logprob", "update_actor", "collect_rollouts:val",
                 "on_step_end", "on_train_end"):
        assert hook in state.calls, hook
    assert "compute_values" not in state.calls  # grpo needs no critic

    assert metrics["training/n_triplets_prompt_too_long"] == 4
    assert metrics["training/n_triplets_dropped_remainder"] == 1
    assert state.rows_seen["compute_old_logprob"] == [22]  # 21 rows padded to a multiple of world_size 2
    assert state.rows_seen["compute_ref_logprob"] == [22]
    assert state.rows_seen["update_actor"] == [16]
    # Balanced over world_size 2: the two halves' token counts are at least as close as before.
    assert metrics["global_seqlen/balanced_max"] - metrics["global_seqlen/balanced_min"] <= \
        metrics["global_seqlen/minmax_diff"]
    assert metrics["global_seqlen/mean"] * 2 == pytest.approx(
        sum(metrics[f"global_seqlen/balanced_{m}"] for m in ("min", "max")))

    batch = recorder.batches[0]
    assert len(batch) == 21
    scores = batch["token_level_scores"].sum(-1)
    assert metrics["critic/score/mean_before_processing"] == pytest.approx(scores.mean().item(), abs=1e-6)
    assert metrics["response_length/mean_before_processing"] == pytest.approx(
        batch["response_mask"].sum(-1).float().mean().item())
    assert "actor/reward_kl_penalty" in metrics and "actor/kl_loss" in metrics
    assert {"actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm",
            "val/reward/mean", "timing_s/step", "timing_s/gen", "timing_s/update_actor",
            "perf/throughput", "critic/advantages/mean_after_processing",
            "global_seqlen/mean"} <= set(metrics)
    assert metrics["training/global_step"] == 1

    run_dir = t.ctx.run_dir
    assert (run_dir / "config.yaml").exists()
    assert {p["name"] for p in json.loads((run_dir / "plugins.json").read_text())} >= {"instant", "estimators"}
    ckpt = run_dir / "checkpoints" / "global_step_1"
    assert (ckpt / "instant.pt").exists() and (ckpt / "core_state.pt").exists()
    logged = read_metrics(run_dir)
    assert [m["step"] for m in logged] == [1]


def test_grpo_advantages_reach_the_actor(make_recipe):
    t = trainer(make_recipe, ["algorithm.ppo_mini_batch_size=1", "trainer.balance_batch=false"], tasks=TASKS[1:], batch_size=5)
    seen = []
    owner, update_actor = t.ctx.slots["update_actor"]
    t.ctx.slots["update_actor"] = (owner, lambda ctx, batch: seen.append(batch) or update_actor(ctx, batch))
    t.train_step(TASKS[1:])
    batch = seen[0]
    assert len(batch) == 20
    scores = batch["token_level_scores"].sum(-1)
    mask = batch["response_mask"].bool()
    for uid in set(batch["uid"]):
        rows = torch.from_numpy(batch["uid"] == uid)
        group = scores[rows]
        expected = (group - group.mean()) / (group.std() + 1e-6)
        adv = batch["advantages"][rows]
        for row, value in zip(range(len(group)), expected):
            assert torch.allclose(adv[row][mask[rows][row]], value.expand(int(mask[rows][row].sum())), atol=1e-5)


def test_critic_path_with_gae_and_warmup(make_recipe):
    t = trainer(make_recipe, ["algorithm.estimator=gae", "trainer.total_steps=2", "trainer.critic_warmup=2"],
                tasks=TASKS[1:], batch_size=5)
    metrics = t.fit()
    state = t.ctx.state["instant"]
    assert state.calls.count("compute_values") == 2 and state.calls.count("update_critic") == 2
    assert state.calls.count("update_actor") == 1  # step 1 is critic warm-up
    assert "critic/vf_loss" in metrics and "critic/values/mean_before_processing" in metrics
    assert "critic/vf_explained_var_after_processing" in metrics


def test_every_rollout_failing_is_a_logged_skipped_step(make_recipe):
    t = trainer(make_recipe, ["plugins.instant.fail_every=1", "trainer.total_steps=2"])
    metrics = t.fit()
    assert metrics["training/skipped_step"] == 1.0
    state = t.ctx.state["instant"]
    assert "update_actor" not in state.calls and "on_train_end" in state.calls
    assert [m["training/skipped_step"] for m in read_metrics(t.ctx.run_dir)] == [1.0, 1.0]


def test_fewer_rows_than_a_mini_batch_skips_the_update(make_recipe):
    t = trainer(make_recipe, ["algorithm.ppo_mini_batch_size=64", "trainer.total_steps=1"])
    metrics = t.fit()
    assert metrics["training/skipped_step"] == 1.0
    assert metrics["training/n_triplets_dropped_remainder"] == 20


def test_val_only_validates_and_stops(make_recipe):
    t = trainer(make_recipe, ["trainer.val_before_train=true", "trainer.val_only=true", "trainer.total_steps=5"])
    metrics = t.fit()
    assert "val/reward/mean" in metrics and metrics["val/n_rollouts"] == 3
    assert "update_actor" not in t.ctx.state["instant"].calls
    assert [m["step"] for m in read_metrics(t.ctx.run_dir)] == [0]


def test_resume_continues_the_same_trajectory(make_recipe, tmp_path):
    common = ["trainer.save_freq=2", "plugins.instant.fail_every=5", "algorithm.kl_ctrl.type=adaptive",
              "algorithm.use_kl_in_reward=true"]
    straight = trainer(make_recipe, common + ["trainer.total_steps=4", f"trainer.run_dir={tmp_path / 'a'}"])
    straight.fit()
    first = trainer(make_recipe, common + ["trainer.total_steps=2", f"trainer.run_dir={tmp_path / 'b'}"])
    first.fit()
    resumed = trainer(make_recipe, common + ["trainer.total_steps=4", f"trainer.run_dir={tmp_path / 'b'}"])
    resumed.fit()

    def comparable(m):
        return {k: v for k, v in m.items() if not k.startswith(("timing", "perf"))}

    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [m["step"] for m in b] == [1, 2, 3, 4]
    for ma, mb in zip(a, b):
        assert comparable(ma) == comparable(mb)
    assert torch.equal(straight.ctx.state["instant"].logits, resumed.ctx.state["instant"].logits)


@pytest.mark.parametrize("estimator", ["gigpo", "turn_grpo"])
def test_resume_with_a_step_level_estimator_continues_the_same_trajectory(make_recipe, tmp_path, estimator):
    """The step-level estimators keep nothing between steps: a resumed run repeats an uninterrupted one.
    Rows of 3 calls each come from agl-plugin-traces' transition aggregator (the per-call columns)."""
    recorder = BatchRecorder()
    common = ["trainer.save_freq=2", f"algorithm.estimator={estimator}", "algorithm.gamma=0.9",
              "plugins.instant.turns=3", "plugins.traces.aggregator=transition"]
    flags = ("instant", "traces")
    trainer(make_recipe, common + ["trainer.total_steps=4", f"trainer.run_dir={tmp_path / 'a'}"],
            recorder=recorder, flags=flags).fit()
    trainer(make_recipe, common + ["trainer.total_steps=2", f"trainer.run_dir={tmp_path / 'b'}"], flags=flags).fit()
    trainer(make_recipe, common + ["trainer.total_steps=4", f"trainer.run_dir={tmp_path / 'b'}"], flags=flags).fit()

    batch = recorder.batches[0]
    assert batch.meta["aggregator"] == "transition" and "turn_ids" in batch and "call_turns" in batch
    assert batch["advantages"].abs().sum() > 0  # the estimator gave credit

    def comparable(m):
        return {k: v for k, v in m.items() if not k.startswith(("timing", "perf"))}

    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [m["step"] for m in b] == [1, 2, 3, 4]
    assert "advantage/calls" in a[0]  # reported through ctx
    for ma, mb in zip(a, b):
        assert comparable(ma) == comparable(mb)


class Sequence:
    """Records, in order, the steps logged and the checkpoints written, and what ``on_train_start`` saw."""

    AGL_HOOK_API = HOOK_API_VERSION

    def __init__(self):
        self.events = []

    @hookimpl
    def on_train_start(self, ctx):
        self.events.append(("start", ctx.step, ctx.purge_step, ctx.run_id))

    @hookimpl
    def log_metrics(self, ctx, metrics, step):
        self.events.append(("log", step))

    @hookimpl
    def save_checkpoint(self, ctx, path):
        self.events.append(("save", ctx.step))


def test_a_step_is_logged_before_its_checkpoint_and_checkpoints_carry_the_run_id(make_recipe):
    seen = Sequence()
    recipe, pset = make_recipe(["trainer.total_steps=2", "trainer.save_freq=1", "trainer.test_freq=1",
                                "data.train_batch_size=5"], plugins=[("sequence", seen)], flags=["instant"])
    t = Trainer(recipe, pset, train_tasks=TASKS[1:], val_tasks=VAL)
    t.fit()
    run_id = json.loads((t.ctx.run_dir / "run.json").read_text())["run_id"]
    assert seen.events == [("start", 0, 0, run_id), ("log", 0), ("log", 1), ("save", 1), ("log", 2), ("save", 2)]
    state = torch.load(t.ctx.run_dir / "checkpoints/global_step_2" / CORE_STATE, weights_only=False)
    assert state["run_id"] == run_id == t.ctx.run_id


def test_a_resumed_run_drops_the_logged_steps_after_its_checkpoint(make_recipe):
    def run(overrides, seen=None):
        recipe, pset = make_recipe(["trainer.save_freq=2", "data.train_batch_size=5", *overrides],
                                   plugins=[("sequence", seen)] if seen else [], flags=["instant"])
        Trainer(recipe, pset, train_tasks=TASKS[1:], val_tasks=VAL).fit()
        return recipe.trainer.run_dir

    run_dir = run(["trainer.total_steps=3"])
    with open(f"{run_dir}/metrics.jsonl", "a") as f:
        f.write('{"step": 4, "actor/pg_loss": 0.5}\n{"step": 5, "actor/pg')  # a killed process's last lines
    seen = Sequence()
    run(["trainer.total_steps=4", "trainer.resume=auto"], seen)
    assert seen.events[0][:3] == ("start", 3, 4)  # resumed at step 3: steps from 4 on are logged again
    logged = read_metrics(Path(run_dir))
    assert [m["step"] for m in logged] == [0, 1, 2, 3, 4]
    assert "training/global_step" in logged[-1]  # step 4 as this run logged it, not the killed one's line


def test_resume_never_refuses_a_run_directory_that_holds_a_run(make_recipe):
    recipe, pset = make_recipe(["trainer.total_steps=1", "data.train_batch_size=5"], flags=["instant"])
    Trainer(recipe, pset, train_tasks=TASKS[1:], val_tasks=VAL).fit()
    recipe, pset = make_recipe(["trainer.total_steps=1", "data.train_batch_size=5", "trainer.resume=never"],
                               flags=["instant"])
    with pytest.raises(ConfigError, match="holds a previous run and trainer.resume is 'never'"):
        Trainer(recipe, pset, train_tasks=TASKS[1:], val_tasks=VAL).fit()


def test_epochs_set_total_steps(make_recipe):
    t = trainer(make_recipe, ["trainer.total_epochs=2", "data.train_batch_size=2"])
    assert t.total_steps == 2 * (len(TASKS) // 2)


def test_no_aggregator_stage_is_a_clear_error(make_recipe):
    recipe, pset = make_recipe(["data.train_batch_size=6", "trainer.val_before_train=false"],
                               flags=["instant"])
    t = Trainer(recipe, pset, train_tasks=TASKS, val_tasks=[])
    t.plan.post_process = []
    with pytest.raises(RuntimeError, match="enable a trace aggregator plugin"):
        t.train_step(TASKS)


def test_the_instant_policy_learns(make_recipe):
    t = trainer(make_recipe, ["trainer.total_steps=25", "trainer.test_freq=25", "algorithm.ppo_epochs=2",
                              "trainer.val_before_train=true"], tasks=TASKS[1:], batch_size=5)
    t.fit()
    logged = read_metrics(t.ctx.run_dir)
    assert logged[0]["val/reward/mean"] < 0.5
    assert logged[-1]["val/reward/mean"] == 1.0
    assert np.mean([m["critic/score/mean_before_processing"] for m in logged[-5:]]) > 0.5
