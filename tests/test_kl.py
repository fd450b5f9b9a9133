"""KL-in-reward and KL coefficient controllers against verl 0.9.1."""

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from agl_core.algorithms import kl as ours

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
from verl.protocol import DataProto  # noqa: E402
from verl.trainer.ppo.ray_trainer import apply_kl_penalty as verl_apply_kl_penalty  # noqa: E402

B, T = 10, 14


def controllers(kind: str):
    """The same controller twice: ours and verl's."""
    if kind == "fixed":
        return ours.FixedKLController(0.05), core_algos.FixedKLController(0.05)
    return (
        ours.AdaptiveKLController(init_kl_coef=0.2, target_kl=0.02, horizon=500),
        core_algos.AdaptiveKLController(init_kl_coef=0.2, target_kl=0.02, horizon=500),
    )


@pytest.mark.parametrize("kind", ["fixed", "adaptive"])
def test_controllers_follow_verl(kind):
    mine, theirs = controllers(kind)
    rng = np.random.default_rng(0)
    # KLs from far below to far above target, so the ±20% clip engages both ways.
    for current_kl, n_steps in zip(rng.uniform(0.0, 0.06, size=50), rng.integers(1, 400, size=50)):
        mine.update(current_kl=float(current_kl), n_steps=int(n_steps))
        theirs.update(current_kl=float(current_kl), n_steps=int(n_steps))
        assert mine.value == pytest.approx(float(theirs.value), rel=1e-12)


def kl_batch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=gen)
    lengths[0] = 0  # an empty response contributes KL 0 to the batch mean
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    old = -torch.rand(B, T, generator=gen) * 4
    ref = old + torch.randn(B, T, generator=gen) * 0.3
    scores = torch.zeros(B, T)
    scores[torch.arange(B), (lengths - 1).clamp(min=0)] = torch.randn(B, generator=gen)
    return scores, old, ref, mask


@pytest.mark.parametrize("controller", ["fixed", "adaptive"])
@pytest.mark.parametrize("kl_penalty", ["kl", "abs", "mse", "low_var_kl", "k3+"])
def test_apply_kl_penalty_matches_verl_over_several_steps(controller, kl_penalty):
    mine, theirs = controllers(controller)
    for step in range(3):
        scores, old, ref, mask = kl_batch(step)
        rewards, metrics = ours.apply_kl_penalty(scores, old, ref, mask, mine, kl_penalty=kl_penalty)
        data = DataProto.from_dict(
            tensors={"token_level_scores": scores, "old_log_probs": old, "ref_log_prob": ref, "response_mask": mask}
        )
        data, ref_metrics = verl_apply_kl_penalty(data, theirs, kl_penalty=kl_penalty)

        assert_close(rewards, data.batch["token_level_rewards"], atol=1e-5, rtol=1e-5)
        assert metrics.keys() == ref_metrics.keys()
        for key in metrics:
            assert metrics[key] == pytest.approx(float(ref_metrics[key]), rel=1e-5, abs=1e-7)
        # The controller was updated after β was read, and identically.
        assert mine.value == pytest.approx(float(theirs.value), rel=1e-6)
