"""Plugin ``sft``: fine-tune on the rows a filter keeps — alone (``algorithm.policy_loss.name=sft``) or beside the
PPO loss (``sft_ppo``).

Enable it and pick a loss::

    algorithm: {policy_loss: {name: sft}}          # or sft_ppo: PPO + plugins.sft.coef * SFT
    plugins:
      sft: {min_reward: 1.0}                      # rejection sampling: train on the won games only

Hooks:

* ``register_policy_losses``: ``sft`` and ``sft_ppo``
  (:mod:`agl_plugin_teachers.sft_losses`).
* ``post_process_batch`` (``AGL_ORDER = 40``, after the trace aggregator):
  a row is kept when its score (its rollout's reward, which the aggregators
  put on its tokens) is at least ``min_reward``. With ``sft`` the other rows
  are dropped; with ``sft_ppo`` every row stays (PPO learns from them all)
  and the column ``sft_mask`` marks the kept ones. Metrics ``sft/rows_kept``,
  ``sft/rows``.
* ``on_train_start``: refuses a run whose policy loss is neither.

The SFT term is exact per mini-batch with ``plugins.torch.actor.micro_batch_size``
unset; with micro-batches each one's term is weighted by its share of the
mini-batch's response tokens, not of its kept tokens.
"""

from __future__ import annotations

import functools

from agl_core import HOOK_API_VERSION, hookimpl
from agl_core.plugins import PluginError

from agl_plugin_teachers.settings import SftConfig

AGL_HOOK_API = HOOK_API_VERSION
AGL_ORDER = 40  # after the trace aggregator (5), before the teacher (50): a teacher scores only kept rows
NAME = "sft"
LOSSES = ("sft", "sft_ppo")


@hookimpl
def plugin_config_schema():
    return SftConfig


@hookimpl
def register_policy_losses(register, settings):
    from agl_plugin_teachers import sft_losses

    register("sft", sft_losses.sft_loss)
    register("sft_ppo", functools.partial(sft_losses.sft_ppo_loss, coef=(settings or SftConfig()).coef))


@hookimpl
def on_train_start(ctx):
    name = ctx.config.algorithm.policy_loss.name
    if name not in LOSSES:
        raise PluginError(f"plugins.sft is active but algorithm.policy_loss.name is {name!r}: set it to sft "
                          f"(fine-tuning alone) or sft_ppo (beside the PPO loss)")


@hookimpl
def post_process_batch(ctx, batch):
    if len(batch) == 0 or "input_ids" not in batch:
        return batch
    cfg: SftConfig = ctx.plugin_config(NAME)
    scores = batch["token_level_scores"].sum(-1)
    keep = scores >= cfg.min_reward if cfg.min_reward is not None else scores == scores
    ctx.step_metrics.update({"sft/rows_kept": float(keep.sum()), "sft/rows": float(len(batch))})
    if ctx.config.algorithm.policy_loss.name == "sft":
        return batch[keep.nonzero().flatten().numpy()]
    batch["sft_mask"] = keep[:, None].to(batch["response_mask"].dtype).expand_as(batch["response_mask"]).clone()
    return batch
