"""SFT: the loss is the token NLL of a tiny model (checked against torch's cross-entropy over the sequence),
the filter keeps the rows it should, and whole runs train with ``sft`` and ``sft_ppo``."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from agl_core.data import Batch
from agl_core.plugins import PluginError
from agl_plugin_teachers import sft
from agl_plugin_teachers.settings import SftConfig

from agl_core.config import PolicyLossConfig
from agl_plugin_teachers.sft_losses import sft_loss, sft_ppo_loss
from agl_plugin_torch.forward import response_logprobs
from agl_plugin_torch.testing import sampled_rows

from runs import logged, recipe_file, train


def reference_nll(model, batch, rows) -> torch.Tensor:
    """Mean cross-entropy of the response tokens of ``rows``, each row's real tokens in a forward pass alone."""
    losses = []
    prompt_width = batch["prompts"].shape[1]
    for row in rows:
        real = batch["attention_mask"][row].bool()
        ids = batch["input_ids"][row][real]
        n = int(batch["response_mask"][row].sum())
        logits = model(input_ids=ids[None]).logits[0]
        losses.append(torch.nn.functional.cross_entropy(logits[-n - 1:-1], ids[-n:], reduction="none"))
        assert int(real[prompt_width:].sum()) == n
    return torch.cat(losses).mean()


def test_the_sft_loss_is_the_token_nll_and_its_gradient(backend):
    model = backend.actor
    batch = sampled_rows(backend, n=6, max_tokens=5)
    keep = torch.tensor([1, 0, 1, 1, 0, 1])
    config = PolicyLossConfig(loss_agg_mode="token-mean")
    log_prob, _ = response_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                                    batch["responses"])
    mask = batch["response_mask"]
    loss, metrics = sft_loss(batch["old_log_probs"], log_prob, None, mask, config,
                             sft_mask=keep[:, None].expand_as(mask))
    ours = torch.autograd.grad(loss, list(model.parameters()))
    reference = reference_nll(model, batch, [0, 2, 3, 5])
    theirs = torch.autograd.grad(reference, list(model.parameters()))
    assert loss.item() == pytest.approx(reference.item(), abs=1e-5)
    assert metrics["sft_nll"] == pytest.approx(reference.item(), abs=1e-5)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_sft_ppo_is_ppo_plus_coef_times_the_nll(backend):
    batch = sampled_rows(backend, n=4, max_tokens=5)
    config = PolicyLossConfig()
    log_prob = batch["old_log_probs"] + 0.01
    advantages = torch.randn(batch["response_mask"].shape, generator=torch.Generator().manual_seed(0))
    mask = batch["response_mask"]
    total, metrics = sft_ppo_loss(batch["old_log_probs"], log_prob, advantages, mask, config, coef=0.5)
    nll, _ = sft_loss(batch["old_log_probs"], log_prob, advantages, mask, config)
    assert total.item() == pytest.approx(metrics["ppo_loss"] + 0.5 * nll.item(), abs=1e-6)
    # no kept row in a micro-batch: the SFT term is 0, not NaN
    _, metrics = sft_ppo_loss(batch["old_log_probs"], log_prob, advantages, mask, config, coef=0.5,
                              sft_mask=torch.zeros_like(mask))
    assert metrics["sft_nll"] == 0.0


def stage_context(loss: str, min_reward):
    """What the stage reads of ``ctx``: its section, the policy loss's name, the step's metrics."""
    algorithm = SimpleNamespace(policy_loss=SimpleNamespace(name=loss))
    return SimpleNamespace(config=SimpleNamespace(algorithm=algorithm), step_metrics={},
                           plugin_config=lambda name: SftConfig(min_reward=min_reward))


def scored_rows(scores) -> Batch:
    n = len(scores)
    token_scores = torch.zeros(n, 3)
    token_scores[:, 2] = torch.tensor(scores)  # the aggregators put a row's reward on its last token
    return Batch({"input_ids": torch.ones(n, 5, dtype=torch.long), "token_level_scores": token_scores,
                  "response_mask": torch.ones(n, 3, dtype=torch.long)},
                 {"rollout_id": np.array([f"r{i}" for i in range(n)], dtype=object)})


def test_the_filter_drops_the_rows_below_min_reward_for_sft_and_marks_them_for_sft_ppo():
    ctx = stage_context("sft", 0.5)
    kept = sft.post_process_batch(ctx, scored_rows([1.0, 0.0, 0.5, 0.2]))
    assert kept["rollout_id"].tolist() == ["r0", "r2"]
    assert ctx.step_metrics == {"sft/rows_kept": 2.0, "sft/rows": 4.0}
    ctx = stage_context("sft_ppo", 0.5)
    marked = sft.post_process_batch(ctx, scored_rows([1.0, 0.0, 0.5, 0.2]))
    assert len(marked) == 4 and marked["sft_mask"].tolist() == [[1] * 3, [0] * 3, [1] * 3, [0] * 3]
    everything = sft.post_process_batch(stage_context("sft", None), scored_rows([0.0, -1.0]))
    assert len(everything) == 2


@pytest.mark.parametrize("loss", ["sft", "sft_ppo"])
def test_a_run_trains_with_the_sft_losses(tmp_path, loss):
    """Every row kept (no min_reward): ``sft`` is plain fine-tuning on the samples, and its NLL is logged."""
    path = recipe_file(tmp_path, algorithm={"policy_loss": {"name": loss}, "ppo_mini_batch_size": 2},
                       plugins={"sft": {"coef": 0.5}})
    metrics = logged(train(path, ["sft"]).ctx.run_dir)
    for step in (1, 2):
        assert metrics[step]["sft/rows_kept"] == metrics[step]["sft/rows"] >= 4
        assert metrics[step]["actor/sft_nll"] > 0
        assert ("actor/ppo_loss" in metrics[step]) == (loss == "sft_ppo")


def test_a_run_with_the_sft_plugin_but_another_loss_is_refused(tmp_path):
    with pytest.raises(PluginError, match="policy_loss.name is 'vanilla'"):
        train(recipe_file(tmp_path, plugins={"sft": {}}), ["sft"])
