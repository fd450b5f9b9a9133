"""Test support for agl-plugin-verl: a tiny local model, a recipe for the CPU workers, a rollout plugin, Ray.

The rollouts come from :class:`BanditRollouts`, a plugin that fills
``collect_rollouts`` and ``post_process_batch``: its responses are drawn
uniformly from a few tokens and rewarded for the share of ``TARGET`` tokens,
so a policy that learns puts more probability on ``TARGET``. Everything
else of the step is the verl plugin's, through verl's real worker groups.
"""

from __future__ import annotations

import faulthandler
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from agl_core import HOOK_API_VERSION, hookimpl
from agl_core.algorithms.losses import ppo_clip_loss
from agl_core.config import load
from agl_core.data import Batch, Rollout, Triplet
from agl_core.loop import Trainer

WORDS = [f"w{i}" for i in range(12)]


def make_tiny_model(directory: Path) -> Path:
    """A 2-layer Llama (hidden 32) with a word tokenizer, made by agl-plugin-torch and saved for ``from_pretrained``."""
    from agl_plugin_torch.modeling import create
    from agl_plugin_torch.settings import ModelConfig

    build = {"architecture": "llama", "vocabulary": WORDS, "hidden_size": 32, "num_layers": 2, "num_heads": 2}
    return create(ModelConfig(build=build, device="cpu"), directory, seed=0)


def _token_ids() -> list[int]:
    from agl_plugin_torch.modeling import SPECIAL_TOKENS

    return list(range(len(SPECIAL_TOKENS), len(SPECIAL_TOKENS) + 6))


TOKENS = _token_ids()  # the words the bandit responses are made of
TARGET = TOKENS[2]


def cpu_overrides(model_dir: Path, workers: int = 2) -> list[str]:
    """Recipe overrides: verl's CPU workers on ``workers`` processes and the tiny model."""
    verl = "plugins.verl."
    return [f"{verl}trainer.device=cpu", f"{verl}trainer.n_gpus_per_node={workers}",
            f"{verl}actor_rollout_ref.model.path={model_dir}",
            f"{verl}actor_rollout_ref.actor.optim.lr=0.01", f"{verl}critic.optim.lr=0.01"]


def probe_batch(rows: int, prompt: list[int], response_length: int) -> Batch:
    """``rows`` identical rows whose response is ``TARGET`` repeated: their log-prob measures what the actor learnt."""
    prompts = torch.tensor([prompt] * rows)
    responses = torch.full((rows, response_length), TARGET)
    mask = torch.ones(rows, len(prompt) + response_length, dtype=torch.long)
    return Batch(tensors={"prompts": prompts, "responses": responses,
                          "input_ids": torch.cat([prompts, responses], 1), "attention_mask": mask,
                          "position_ids": mask.cumsum(-1) - 1,
                          "response_mask": torch.ones(rows, response_length, dtype=torch.long)})


def test_policy_loss(old_log_prob, log_prob, advantages, response_mask, config):
    """An agl_core-only policy loss name (agl_core's clipped PPO): verl finds it only through the bridge."""
    return ppo_clip_loss(old_log_prob, log_prob, advantages, response_mask, clip_ratio=config.clip_ratio,
                         clip_ratio_low=config.clip_ratio_low, clip_ratio_high=config.clip_ratio_high,
                         clip_ratio_c=config.clip_ratio_c, loss_agg_mode=config.loss_agg_mode)


test_policy_loss.__test__ = False  # a loss, not a pytest test


def mean_baseline(batch, config):
    """An agl_core-only estimator: the row's reward minus the batch mean, on every response token."""
    mask = batch["response_mask"].float()
    score = batch["token_level_rewards"].sum(-1)
    advantages = (score - score.mean()).unsqueeze(-1) * mask
    return advantages, advantages


class BanditRollouts:
    """Rollouts of a fixed bandit policy over :data:`TOKENS`, rewarded for :data:`TARGET`; probes the verl actor.

    ``records`` collects, per step, the actor's mean log-prob of the probe
    batch at the start and end of the step, and the logged metrics.
    """

    AGL_HOOK_API = HOOK_API_VERSION

    def __init__(self, response_length: int = 3, seed: int = 0):
        self.response_length = response_length
        self.rng = np.random.default_rng(seed)
        self.records: dict[str, list] = {"start": [], "end": [], "metrics": []}

    @hookimpl
    def register_estimators(self, register):
        register("mean_baseline", mean_baseline)

    @hookimpl
    def register_policy_losses(self, register):
        register("agl_test_clip", test_policy_loss)

    @hookimpl
    def collect_rollouts(self, ctx, tasks, mode):
        rollouts = []
        for task in tasks:
            for sample in range(ctx.config.rollout.n):
                length = int(self.rng.integers(1, self.response_length + 1))
                tokens = [int(t) for t in self.rng.choice(TOKENS, size=length)]
                rollout_id = f"{mode}-{ctx.step}-{task.id}-{sample}"
                triplet = Triplet(prompt_ids=task.input["prompt_ids"], response_ids=tokens, rollout_id=rollout_id,
                                  turn_index=0)
                rollouts.append(Rollout(rollout_id=rollout_id, task_id=task.id, sample_index=sample,
                                        status="succeeded", final_reward=tokens.count(TARGET) / length,
                                        triplets=[triplet]))
        return rollouts

    @hookimpl
    def post_process_batch(self, ctx, batch):
        from agl_plugin_instant import transition_rows

        if "rollouts" not in batch.meta or "input_ids" in batch:
            return batch
        return transition_rows(batch.meta["rollouts"], ctx.config.data.max_prompt_length,
                               ctx.config.data.max_response_length)

    def probe(self, ctx) -> float:
        from agl_plugin_verl import calls
        from agl_plugin_verl.plugin import run_of

        batch = probe_batch(ctx.world_size, [3, 4, 5], self.response_length)
        log_probs, _, _ = calls.compute_log_prob(run_of(ctx).groups.actor, batch, 1.0, calculate_entropy=False)
        return float(log_probs.mean())

    @hookimpl
    def on_step_start(self, ctx, step):
        self.records["start"].append((step, self.probe(ctx)))

    @hookimpl
    def on_step_end(self, ctx, step, metrics):
        self.records["end"].append((step, self.probe(ctx)))

    @hookimpl
    def log_metrics(self, ctx, metrics, step):
        self.records["metrics"].append((step, dict(metrics)))


def bandit_tasks(n: int) -> list:
    from agl_core.data import Task

    return [Task(id=f"t{i}", input={"prompt_ids": [3 + i % 4, 4, 5]}) for i in range(n)]


BANDIT_RUN = [
    "trainer.progress=false", "trainer.save_freq=2", "trainer.val_before_train=false",
    "data.train_batch_size=4", "data.max_prompt_length=4", "data.max_response_length=3", "rollout.n=2",
    "algorithm.ppo_mini_batch_size=4", "algorithm.ppo_epochs=2", "algorithm.policy_loss.use_kl_loss=true",
]
"""The recipe of a short bandit run with a KL loss and a checkpoint every 2 steps (the driver tests add the rest)."""


def train_bandit(run_dir: Path, model_dir: Path, total_steps: int, resume: str, overrides: list[str],
                 extra_plugins: list) -> Trainer:
    """Train the bandit (a :class:`BanditRollouts` among ``extra_plugins``) on verl's CPU workers."""
    recipe, plugins = load(None, [f"trainer.run_dir={run_dir}", f"trainer.total_steps={total_steps}",
                                  f"trainer.resume={resume}", *BANDIT_RUN, *overrides, *cpu_overrides(model_dir)],
                           extra_plugins=extra_plugins)
    trainer = Trainer(recipe, plugins, train_tasks=bandit_tasks(4), val_tasks=[])
    trainer.fit()
    return trainer


def first_and_resumed(root: Path, train) -> tuple[Path, object, object]:
    """``(model_dir, first, resumed)``: ``train`` two steps (a checkpoint at step 2), then resumed to step 3.

    ``train(run_dir, model_dir, total_steps, resume)``; both in one Ray session, on a tiny model in ``root``.
    """
    model_dir = make_tiny_model(root / "model")
    with ray_session():
        first = train(root / "run", model_dir, total_steps=2, resume="never")
        resumed = train(root / "run", model_dir, total_steps=3, resume="auto")
    return model_dir, first, resumed


@contextmanager
def ray_session(timeout_s: float = 240) -> Iterator[None]:
    """A local Ray on the machine's two cores; the process is killed with a traceback after ``timeout_s``.

    A Ray call that can never be scheduled waits forever; the watchdog turns
    that into a failure with every thread's stack instead of a hung CI job.
    """
    import ray
    from ray import cloudpickle

    faulthandler.dump_traceback_later(timeout_s, exit=True)
    # The test's own estimator and loss travel to the workers by value: this module is not importable there.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        faulthandler.cancel_dump_traceback_later()
