"""agl-plugin-instant: an in-process backend that fills every compute slot in microseconds.

The "model" is one row of logits over a tiny vocabulary (a bandit policy):
every response token is drawn from ``softmax(logits)``, whatever the prompt.
An agent's reward is the fraction of its response tokens that equal
``target_token``. Everything else is real: log-probs and entropy come from the
logits, the actor is updated with the registered policy loss over PPO
mini-batches and epochs, the critic is a single learned value, and the state is
checkpointed. It exists to exercise the core loop end to end (tests, the loop
benchmark, the quick start) without a language model; the embedded PyTorch
backend (agl-plugin-torch) is the one that trains an LLM.

It is also a complete example of a plugin: one object, one hook per stage, its
own recipe section (``plugins.instant``), its state kept in ``ctx.state``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from agl_core import HOOK_API_VERSION, hookimpl
from agl_core.data import Batch, Rollout, Triplet
from agl_core.lazy_import import LazyModule

if TYPE_CHECKING:
    import torch
    from agl_core.algorithms import losses
else:  # imported when a hook first computes: importing the plugin (`agl plugins`) stays cheap
    torch = LazyModule("torch", globals())
    losses = LazyModule("agl_core.algorithms.losses", globals())

NAME = "instant"


class InstantConfig(BaseModel):
    """The recipe section ``plugins.instant``."""

    model_config = ConfigDict(extra="forbid")
    vocab_size: int = Field(8, ge=2)
    target_token: int = Field(3, ge=0)
    max_new_tokens: int = Field(4, ge=1, description="responses have 1..max_new_tokens tokens")
    turns: int = Field(1, ge=1, description="model calls (rows) per rollout")
    lr: float = 0.1
    critic_lr: float = 0.1
    cliprange_value: float = 0.5
    world_size: int = Field(1, ge=1, description="pretend data-parallel size (padding, balancing)")
    fail_every: int = Field(0, ge=0, description="every Nth rollout fails (0: none)")


@dataclass
class InstantState:
    """Everything the backend learns or counts during a run."""

    logits: torch.Tensor
    ref_logits: torch.Tensor
    value: torch.Tensor
    actor_optim: torch.optim.Optimizer
    critic_optim: torch.optim.Optimizer
    generator: torch.Generator
    n_rollouts: int = 0
    calls: list[str] = field(default_factory=list)
    rows_seen: dict[str, list[int]] = field(default_factory=dict)

    def record(self, hook: str, batch: Batch | None = None) -> None:
        """Note a hook call (and the rows it got) for tests to assert on."""
        self.calls.append(hook)
        if batch is not None:
            self.rows_seen.setdefault(hook, []).append(len(batch))

    def state_dict(self) -> dict:
        return {"logits": self.logits.detach().clone(), "value": self.value.detach().clone(),
                "actor_optim": self.actor_optim.state_dict(), "critic_optim": self.critic_optim.state_dict(),
                "generator": self.generator.get_state(), "n_rollouts": self.n_rollouts}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            self.logits.copy_(state["logits"])
            self.value.copy_(state["value"])
        self.actor_optim.load_state_dict(state["actor_optim"])
        self.critic_optim.load_state_dict(state["critic_optim"])
        self.generator.set_state(state["generator"])
        self.n_rollouts = state["n_rollouts"]


def state_of(ctx) -> InstantState:
    """The run's backend state, created on first use (``load_checkpoint`` may come first)."""
    if NAME not in ctx.state:
        cfg = ctx.plugin_config(NAME)
        logits = torch.zeros(cfg.vocab_size, requires_grad=True)
        value = torch.zeros((), requires_grad=True)
        generator = torch.Generator().manual_seed(ctx.config.trainer.seed)
        ctx.state[NAME] = InstantState(
            logits=logits, ref_logits=logits.detach().clone(), value=value,
            actor_optim=torch.optim.Adam([logits], lr=cfg.lr),
            critic_optim=torch.optim.Adam([value], lr=cfg.critic_lr), generator=generator)
    return ctx.state[NAME]


def response_logprobs(logits: torch.Tensor, responses: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """log π(token) for every response position, 0 where masked. Shape of ``responses``."""
    return torch.log_softmax(logits, -1)[responses] * response_mask


class InstantBackend:
    AGL_HOOK_API = HOOK_API_VERSION
    AGL_ORDER = 10  # its aggregator must be the first post_process_batch stage

    @hookimpl
    def plugin_config_schema(self):
        return InstantConfig

    @hookimpl
    def on_train_start(self, ctx):
        ctx.world_size = ctx.plugin_config(NAME).world_size
        state_of(ctx).record("on_train_start")

    @hookimpl
    def on_step_start(self, ctx, step):
        state_of(ctx).record("on_step_start")

    @hookimpl
    def on_step_end(self, ctx, step, metrics):
        state_of(ctx).record("on_step_end")

    @hookimpl
    def on_train_end(self, ctx):
        state_of(ctx).record("on_train_end")

    @hookimpl
    def policy_endpoints(self, ctx):
        return []  # no HTTP server: collect_rollouts samples in process

    @hookimpl
    def collect_rollouts(self, ctx, tasks, mode):
        cfg, state = ctx.plugin_config(NAME), state_of(ctx)
        state.record(f"collect_rollouts:{mode}")
        samples = ctx.config.rollout.n if mode == "train" else 1
        probs = torch.softmax(state.logits.detach(), -1)
        rollouts = []
        for task in tasks:
            for sample in range(samples):
                state.n_rollouts += 1
                rollout_id = f"{mode}-{ctx.step}-{task.id}-{sample}"
                if cfg.fail_every and state.n_rollouts % cfg.fail_every == 0:
                    rollouts.append(Rollout(rollout_id=rollout_id, task_id=task.id, sample_index=sample,
                                            status="failed", final_reward=None, error="injected failure"))
                    continue
                triplets, hits, total = [], 0, 0
                for turn in range(cfg.turns):
                    length = int(torch.randint(1, cfg.max_new_tokens + 1, (1,), generator=state.generator))
                    if mode == "train":
                        tokens = torch.multinomial(probs, length, replacement=True, generator=state.generator)
                    else:
                        tokens = probs.argmax().repeat(length)
                    hits, total = hits + int((tokens == cfg.target_token).sum()), total + length
                    triplets.append(Triplet(
                        prompt_ids=list(task.input.get("prompt_ids", [1, 2])) + [turn],
                        response_ids=tokens.tolist(), response_logprobs=probs.log()[tokens].tolist(),
                        reward=None, rollout_id=rollout_id, turn_index=turn))
                rollouts.append(Rollout(rollout_id=rollout_id, task_id=task.id, sample_index=sample,
                                        status="succeeded", final_reward=hits / total, triplets=triplets))
        return rollouts

    @hookimpl
    def post_process_batch(self, ctx, batch):
        state_of(ctx).record("post_process_batch")
        if "rollouts" not in batch.meta or "input_ids" in batch:
            return batch
        return transition_rows(batch.meta["rollouts"], ctx.config.data.max_prompt_length,
                               ctx.config.data.max_response_length)

    @hookimpl
    def compute_old_logprob(self, ctx, batch):
        state = state_of(ctx)
        state.record("compute_old_logprob", batch)
        mask = batch["response_mask"].float()
        with torch.no_grad():
            batch["old_log_probs"] = response_logprobs(state.logits, batch["responses"], mask)
            batch["entropys"] = losses.entropy_from_logits(state.logits).expand_as(mask) * mask
        return batch

    @hookimpl
    def compute_ref_logprob(self, ctx, batch):
        state = state_of(ctx)
        state.record("compute_ref_logprob", batch)
        batch["ref_log_prob"] = response_logprobs(state.ref_logits, batch["responses"], batch["response_mask"].float())
        return batch

    @hookimpl
    def compute_values(self, ctx, batch):
        state = state_of(ctx)
        state.record("compute_values", batch)
        batch["values"] = state.value.detach().expand(batch["responses"].shape) * batch["response_mask"]
        return batch

    @hookimpl
    def update_critic(self, ctx, batch):
        cfg, state = ctx.plugin_config(NAME), state_of(ctx)
        state.record("update_critic", batch)
        mask = batch["response_mask"].float()
        vpreds = state.value.expand(mask.shape) * mask
        loss, clipfrac = losses.value_loss(vpreds, batch["returns"], batch["values"], mask, cfg.cliprange_value,
                                    ctx.config.algorithm.policy_loss.loss_agg_mode)
        state.critic_optim.zero_grad()
        loss.backward()
        state.critic_optim.step()
        return {"critic/vf_loss": loss.item(), "critic/vf_clipfrac": float(clipfrac)}

    @hookimpl
    def update_actor(self, ctx, batch):
        state, algo = state_of(ctx), ctx.config.algorithm
        state.record("update_actor", batch)
        loss_cfg = algo.policy_loss
        policy_loss = ctx.components.get("policy_loss", loss_cfg.name).obj
        totals: dict[str, list[float]] = {}
        for _ in range(algo.ppo_epochs):
            for mini in batch.chunk(len(batch) // algo.ppo_mini_batch_size):
                mask = mini["response_mask"].float()
                log_prob = response_logprobs(state.logits, mini["responses"], mask)
                loss, metrics = policy_loss(mini["old_log_probs"], log_prob, mini["advantages"], mask, loss_cfg)
                metrics = {"actor/pg_loss": loss.item(), **{f"actor/{k}": float(v) for k, v in metrics.items()}}
                if loss_cfg.entropy_coeff:
                    entropy = losses.agg_loss(losses.entropy_from_logits(state.logits).expand_as(mask) * mask, mask,
                                              loss_cfg.loss_agg_mode)
                    loss = loss - loss_cfg.entropy_coeff * entropy
                if loss_cfg.use_kl_loss:
                    kl = losses.agg_loss(losses.kl_penalty(log_prob, mini["ref_log_prob"], loss_cfg.kl_loss_type),
                                         mask, loss_cfg.loss_agg_mode)
                    loss = loss + loss_cfg.kl_loss_coef * kl
                    metrics["actor/kl_loss"] = kl.item()
                state.actor_optim.zero_grad()
                loss.backward()
                metrics["actor/grad_norm"] = float(state.logits.grad.norm())
                state.actor_optim.step()
                for key, value in metrics.items():
                    totals.setdefault(key, []).append(value)
        out = {key: float(np.mean(values)) for key, values in totals.items()}
        out["actor/lr"] = state.actor_optim.param_groups[0]["lr"]
        return out

    @hookimpl
    def save_checkpoint(self, ctx, path):
        torch.save(state_of(ctx).state_dict(), Path(path) / "instant.pt")

    @hookimpl
    def load_checkpoint(self, ctx, path):
        state_of(ctx).load_state_dict(torch.load(Path(path) / "instant.pt", weights_only=False))


def transition_rows(rollouts: list[Rollout], max_prompt_length: int, max_response_length: int) -> Batch:
    """One row per model call, the rollout's reward on the last response token.

    A minimal transition aggregator for this backend's own rollouts (whose
    triplets are already known); agl-plugin-traces is the real one. A prompt
    over ``max_prompt_length`` is kept (left-truncated) and marked in
    ``is_drop_mask`` for the loop to drop after advantages.
    """
    rows = [(r, t) for r in rollouts if r.status == "succeeded" for t in r.triplets]
    n, P, R = len(rows), max_prompt_length, max_response_length
    prompts = torch.zeros(n, P, dtype=torch.long)
    prompt_mask = torch.zeros(n, P, dtype=torch.long)
    responses = torch.zeros(n, R, dtype=torch.long)
    response_mask = torch.zeros(n, R, dtype=torch.long)
    scores = torch.zeros(n, R)
    too_long = torch.zeros(n, dtype=torch.bool)
    for i, (rollout, triplet) in enumerate(rows):
        prompt, response = triplet.prompt_ids[-P:], triplet.response_ids[:R]
        too_long[i] = len(triplet.prompt_ids) > P
        prompts[i, P - len(prompt):] = torch.tensor(prompt)
        prompt_mask[i, P - len(prompt):] = 1
        responses[i, :len(response)] = torch.tensor(response)
        response_mask[i, :len(response)] = 1
        scores[i, len(response) - 1] = rollout.final_reward
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return Batch(
        tensors={
            "prompts": prompts, "responses": responses, "response_mask": response_mask,
            "input_ids": torch.cat([prompts, responses], dim=1), "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "token_level_scores": scores, "is_drop_mask": too_long,
        },
        non_tensors={
            "uid": np.array([r.task_id for r, _ in rows], dtype=object),
            "rollout_id": np.array([r.rollout_id for r, _ in rows], dtype=object),
            "turn_index": np.array([t.turn_index for _, t in rows], dtype=np.int64),
        },
    )


plugin = InstantBackend()
