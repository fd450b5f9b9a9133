"""Step-level group advantages: GRPO whose groups are the rows of one task at one turn.

GRPO compares a row's reward with the other samples of its task. In a
multi-turn rollout a row is one model call, and the calls at turn 0 and at
turn 3 of the same task face different situations; a baseline mixing them
credits a late call with the luck of an early one. Here the group of a row
is its task *and* its turn index, so each call is compared with the calls
made at the same step of the other samples.
"""

from __future__ import annotations

import numpy as np
import torch

from agl_core.algorithms.advantages import grpo


def step_group_advantages(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, uid: np.ndarray,
                          turn_index: np.ndarray, norm_by_std: bool = True,
                          epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)``, both ``(rows, response_length)``: GRPO over groups keyed by ``(uid, turn_index)``.

    A row's score is the sum of its token rewards; its advantage is the score
    minus the mean of its group, divided by the group's std (+ ``epsilon``)
    when ``norm_by_std``, on every response token. A group of one row keeps
    its score, as GRPO does (verl's convention). With one turn per rollout
    this is exactly GRPO.
    """
    groups = np.empty(len(uid), dtype=object)
    groups[:] = list(zip(uid.tolist(), np.asarray(turn_index).tolist()))
    return grpo(token_level_rewards, response_mask, groups, norm_adv_by_std_in_grpo=norm_by_std, epsilon=epsilon)
