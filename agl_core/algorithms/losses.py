"""Loss pieces shared by the training backends: aggregation, PPO clip, KL, entropy, value.

Shapes: ``(B, T)`` for per-token quantities (B responses, T response tokens),
``(B, T, V)`` for logits over a vocabulary of V tokens. Masks are 0/1 (bool, int or
float) and mark the tokens that count. Each function computes the same numbers
(and gradients) as the verl 0.9.1 function named in its docstring.
"""

from collections.abc import Mapping
from typing import Any

import torch

from agl_core.algorithms.advantages import masked_mean

__all__ = [
    "LOSS_AGG_MODES",
    "agg_loss",
    "agg_loss_value",
    "aggregate_rows",
    "entropy_from_logits",
    "entropy_loss",
    "kl_penalty",
    "ppo_clip_loss",
    "value_loss",
]

LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``(B, T)`` to a scalar.

    Modes (L = loss_mat, m = loss_mask, rows with no masked token are left out of
    every per-sequence mean):
        token-mean               sum(L m) / N_tokens
        token-sum                sum(L m)
        seq-mean-token-sum       mean over rows of sum_t L m
        seq-mean-token-mean      mean over rows of (sum_t L m / (sum_t m + 1e-8))
        seq-mean-token-sum-norm  seq-mean-token-sum / loss_scale_factor (default T)

    Under data parallelism each rank holds a micro-batch; pass the global token count
    (``batch_num_tokens``) or global row count (``global_batch_size``) and ``dp_size``,
    and the gradients averaged across ranks equal those of the global mean. With the
    defaults (dp_size=1, counts None) the counts are the local ones.

    ``loss_mask`` is 0/1 (bool, int or float); a token counts where it is non-zero.
    Returns a 0-dim tensor. An all-zero mask gives NaN in the mean modes, as in verl.
    Matches ``verl.trainer.ppo.core_algos.agg_loss`` (0.9.1), all keyword arguments included.
    """
    selected = loss_mask.bool()
    seq_loss = torch.where(selected, loss_mat, 0.0).sum(dim=-1)
    return aggregate_rows(seq_loss, selected.sum(dim=-1), loss_agg_mode, loss_mask.shape[-1], dp_size=dp_size,
                          batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size,
                          loss_scale_factor=loss_scale_factor)


def aggregate_rows(
    seq_loss: torch.Tensor,
    tokens_per_row: torch.Tensor,
    loss_agg_mode: str,
    horizon: int,
    *,
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """The second half of :func:`agg_loss`: reduce per-row masked sums ``(B,)`` to its scalar.

    ``seq_loss`` holds each row's sum of the loss over its masked tokens,
    ``tokens_per_row`` their count, ``horizon`` the number of token columns
    T (the default ``loss_scale_factor``); the other arguments are
    :func:`agg_loss`'s.
    """
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("token-mean with dp_size > 1 needs the global batch_num_tokens")
            batch_num_tokens = tokens_per_row.sum()
        return seq_loss.sum() / batch_num_tokens * dp_size
    if loss_agg_mode == "token-sum":
        # Ranks average their gradients, so scaling by dp_size yields the global sum.
        return seq_loss.sum() * dp_size
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; expected one of {LOSS_AGG_MODES}")
    if loss_agg_mode == "seq-mean-token-mean":
        seq_loss = seq_loss / (tokens_per_row + 1e-8)
    nonempty_rows = tokens_per_row > 0
    if global_batch_size is None:
        if dp_size > 1:
            raise ValueError(f"{loss_agg_mode} with dp_size > 1 needs the global_batch_size")
        global_batch_size = nonempty_rows.sum()
    loss = torch.where(nonempty_rows, seq_loss, 0.0).sum() / global_batch_size * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
        loss = loss / (horizon if loss_scale_factor is None else loss_scale_factor)
    return loss


@torch.no_grad()
def agg_loss_value(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str) -> float:
    """``agg_loss(loss_mat, loss_mask, loss_agg_mode).item()`` for a reported value (the loop's ``actor/entropy``).

    Faster on the CPU: each row's sum is one dot product with the mask as 0/1
    weights, with no masked copy of ``loss_mat``. That equals the masked sum
    whenever it is finite; when a row's is not (an inf or NaN may sit outside
    the mask), the rows are summed again the way :func:`agg_loss` does, where
    values outside the mask never count.
    """
    weight = loss_mask.bool().view(torch.uint8).to(loss_mat.dtype)  # via uint8: bool -> float is a slow path
    seq_loss = torch.linalg.vecdot(loss_mat, weight)
    if not torch.isfinite(seq_loss).all():
        seq_loss = torch.where(weight.bool(), loss_mat, 0.0).sum(dim=-1)
    return aggregate_rows(seq_loss, weight.sum(dim=-1), loss_agg_mode, loss_mask.shape[-1]).item()


def ppo_clip_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    *,
    global_batch_info: Mapping[str, Any] | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate (Schulman et al. 2017) with dual clip (Ye et al. 2020).

    With ρ = exp(clamp(log π - log π_old, ±20)) and advantage A, per token:
        L      = max(-A ρ, -A clip(ρ, 1 - ε_low, 1 + ε_high))
        L_dual = min(L, -A c)                      used where A < 0
    then aggregated with ``agg_loss``. The dual clip bounds the loss of a negative-
    advantage token whose ratio has grown large.

    Args:
        old_log_prob, log_prob, advantages, response_mask: (B, T); gradients flow
            through ``log_prob``.
        clip_ratio: ε; ``clip_ratio_low`` / ``clip_ratio_high`` override either side.
        clip_ratio_c: dual-clip bound c, must be > 1.
        loss_agg_mode: see ``agg_loss``.
        global_batch_info: optional ``agg_loss`` keyword arguments (dp_size,
            batch_num_tokens, global_batch_size, loss_scale_factor), as verl's
            ``ActorConfig.global_batch_info``.
        rollout_is_weights: optional (B, T) importance weights of the off-policy
            correction (:func:`agl_core.algorithms.rollout_correction.tis_weights`),
            multiplying each token's loss before aggregation.

    Returns:
        ``(pg_loss, metrics)``: a 0-dim tensor and floats under the keys
        ``pg_clipfrac`` (share of tokens where the clipped term won),
        ``ppo_kl`` (masked mean of log π_old - log π) and
        ``pg_clipfrac_lower`` (share of tokens where the dual clip applied).
        verl reports the same numbers under ``actor/<key>``; the caller adds the prefix.

    Matches ``compute_policy_loss_vanilla`` of verl 0.9.1, with or without rollout IS weights.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"dual-clip bound clip_ratio_c must be > 1, got {clip_ratio_c}")
    eps_low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    eps_high = clip_ratio if clip_ratio_high is None else clip_ratio_high

    # Clamping the log-ratio keeps exp() finite for tokens whose probability moved a lot.
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    surrogate = -advantages * ratio
    clipped_surrogate = -advantages * torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    clipped_loss = torch.maximum(surrogate, clipped_surrogate)
    dual_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    per_token = torch.where(negative, torch.minimum(clipped_loss, dual_bound), clipped_loss)
    if rollout_is_weights is not None:
        per_token = per_token * rollout_is_weights

    pg_loss = agg_loss(per_token, response_mask, loss_agg_mode, **(global_batch_info or {}))
    metrics = {
        "pg_clipfrac": masked_mean((clipped_surrogate > surrogate).float(), response_mask).item(),
        "ppo_kl": masked_mean(-log_ratio, response_mask).item(),
        "pg_clipfrac_lower": masked_mean(((clipped_loss > dual_bound) & negative).float(), response_mask).item(),
    }
    return pg_loss, metrics


def _kl_estimate(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL(π || π_ref) estimates of Schulman's "Approximating KL divergence" note."""
    log_ratio = logprob - ref_logprob  # log π/π_ref at the sampled token
    if kind in ("kl", "k1"):
        return log_ratio
    if kind == "abs":
        return log_ratio.abs()
    if kind in ("mse", "k2"):
        return 0.5 * log_ratio.square()
    if kind in ("low_var_kl", "k3"):
        # k3 = r - log r - 1 with r = π_ref/π; clamps keep exp() and the result bounded.
        log_r = torch.clamp(ref_logprob - logprob, min=-20, max=20)
        return torch.clamp(torch.exp(log_r) - log_r - 1, min=-10, max=10)
    raise ValueError(f"unknown KL estimator {kind!r}; expected kl/k1, abs, mse/k2, low_var_kl/k3, optionally with '+'")


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference policy.

    Args:
        logprob, ref_logprob: (B, T) log-probabilities of the sampled tokens.
        kind: ``kl``/``k1`` (log ratio), ``abs`` (its absolute value), ``mse``/``k2``
            (half its square), ``low_var_kl``/``k3`` (r - log r - 1, clamped to ±10).
            A trailing ``+`` (e.g. ``k3+``) keeps the forward value but takes the
            gradient of k2, whose gradient is unbiased for the KL's.

    Returns:
        (B, T) estimate, not masked.

    Matches ``verl.trainer.ppo.core_algos.kl_penalty`` of verl 0.9.1 (values and gradients).
    """
    straight_through = kind.endswith("+")
    value = _kl_estimate(logprob, ref_logprob, kind.removesuffix("+"))
    if not straight_through:
        return value
    k2 = 0.5 * (logprob - ref_logprob).square()
    return k2 - k2.detach() + value.detach()


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dimension.

    H = logsumexp(z) - sum_i softmax(z)_i z_i, which needs no log of small probabilities.
    ``logits`` (..., V) -> entropy (...).
    Matches ``verl.utils.torch_functional.entropy_from_logits``.
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def entropy_loss(
    logits: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    global_batch_info: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """Aggregated token entropy: ``agg_loss(entropy_from_logits(logits), response_mask, mode)``.

    ``logits`` (B, T, V), ``response_mask`` (B, T) -> 0-dim tensor.
    ``global_batch_info`` as in ``ppo_clip_loss``.
    Matches ``compute_entropy_loss`` of verl 0.9.1.
    """
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode, **(global_batch_info or {}))


def value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    *,
    global_batch_info: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss of PPO.

        V_clip = clip(V_new, V_old - ε_v, V_old + ε_v)
        L      = 0.5 * agg(max((V_new - R)^2, (V_clip - R)^2))

    Args:
        vpreds: (B, T) new value predictions V_new (gradients flow through them).
        returns: (B, T) targets R; values: (B, T) old predictions V_old.
        response_mask: (B, T); cliprange_value: ε_v (>= 0).
        loss_agg_mode, global_batch_info: see ``agg_loss`` / ``ppo_clip_loss``.

    Returns:
        ``(vf_loss, vf_clipfrac)``: 0-dim tensors; the second is the share of masked
        tokens where the clipped error was the larger one.

    Matches ``compute_value_loss`` of verl 0.9.1.
    """
    clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    unclipped_error = (vpreds - returns).square()
    clipped_error = (clipped - returns).square()
    per_token = torch.maximum(unclipped_error, clipped_error)
    vf_loss = 0.5 * agg_loss(per_token, response_mask, loss_agg_mode, **(global_batch_info or {}))
    vf_clipfrac = masked_mean((clipped_error > unclipped_error).float(), response_mask)
    return vf_loss, vf_clipfrac
