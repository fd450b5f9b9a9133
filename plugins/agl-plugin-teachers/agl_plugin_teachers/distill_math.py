"""On-policy distillation's advantages: the per-token reverse KL between student and teacher, negated.

On the student's own samples, the reverse KL ``KL(student || teacher)`` of a
response is estimated per token by ``log p_student(y_t) - log p_teacher(y_t)``
(Agarwal et al., "On-Policy Distillation of Language Models", GKD, 2024;
Thinking Machines, "On-Policy Distillation", 2025). Its negation is a per-token
reward: a policy-gradient step with advantage ``teacher - student`` at every
token lowers the reverse KL. With ``discount`` 0 each token's advantage is
its own term (the definition); with ``discount`` γ > 0 a token's advantage also
sums the later tokens' terms discounted by γ.
"""

from __future__ import annotations

import torch


def reverse_kl_advantages(teacher_log_probs: torch.Tensor, student_log_probs: torch.Tensor,
                          response_mask: torch.Tensor, discount: float = 0.0) -> torch.Tensor:
    """``(B, T)`` advantages ``teacher - student`` on the response tokens (0 elsewhere), summed forward with
    ``discount``: ``A_t = Σ_{k ≥ t, mask_k} discount^(#masked tokens between) (teacher_k - student_k)``.

    Tokens outside ``response_mask`` (padding, tool output in a trajectory row)
    neither add to nor decay the running sum.
    """
    mask = response_mask.to(teacher_log_probs.dtype)
    terms = (teacher_log_probs - student_log_probs) * mask
    if discount == 0:
        return terms
    out = torch.zeros_like(terms)
    running = torch.zeros_like(terms[:, 0])
    for t in range(terms.shape[1] - 1, -1, -1):
        running = torch.where(mask[:, t] > 0, terms[:, t] + discount * running, running)
        out[:, t] = running * mask[:, t]
    return out


def reverse_kl(teacher_log_probs: torch.Tensor, student_log_probs: torch.Tensor,
               response_mask: torch.Tensor) -> float:
    """The mean over response tokens of ``student - teacher``: the estimate of KL(student || teacher) per token."""
    mask = response_mask.to(teacher_log_probs.dtype)
    return float(((student_log_probs - teacher_log_probs) * mask).sum() / mask.sum().clamp(min=1))
