"""Rows → tensors: rows gathered as flat runs of token ids, laid out as padded tensors in a few vectorised passes.

An aggregator describes each training row with :class:`RowBuilder`: the
row's prompt, then one turn per model call: how many context tokens are new
since the previous call (tool results, environment text, template tokens:
``response_mask = 0``) and how many the model produced (``response_mask =
1``, trainable). Only lengths are recorded per turn; the tokens themselves
are copied once per row from the row's last call, whose prompt + response
holds every token of the row. The builder converts the tokens of each row
in one or two C-level calls (no work per token in Python) and keeps the rest
in flat lists; :meth:`RowBuilder.to_batch` then writes every tensor with
whole-array NumPy operations.

Layout, as the reference trainer and verl expect it: each row is
``P + R`` columns, the prompt left-padded into the first ``P`` and the
response right-padded into the last ``R``.
"""

from __future__ import annotations

import numpy as np
import torch

from agl_core.data import Batch


class RowBuilder:
    """Collects rows (prompt, response runs, rewards, ids) and builds the core :class:`~agl_core.data.Batch`.

    Per row: :meth:`begin`, one :meth:`add_turn` per call, then :meth:`end`.
    Responses are cut at ``max_response_length`` as turns are added, so the
    flat lists hold exactly the tokens that land in the tensors.
    """

    def __init__(self, max_prompt_length: int, max_response_length: int):
        self.P, self.R = max_prompt_length, max_response_length
        self.tokens: list[np.ndarray] = []  # row after row: its kept prompt ids, then its kept response ids
        self.prompt_len: list[int] = []
        self.response_len: list[int] = []
        # Response runs of all rows, in order, in pairs: (context tokens, mask 0), (model tokens, mask 1).
        self.runs: list[int] = []
        self.logprobs: list[float] = []  # log-probs of the kept model tokens, in order
        self.logprobs_known = True  # every model run so far came with its log-probs
        self.score_row: list[int] = []
        self.score_pos: list[int] = []
        self.score_value: list[float] = []
        self.is_drop: list[bool] = []
        self.uid: list[str] = []
        self.rollout_id: list[str] = []
        self.turn_index: list[int] = []
        self.n_prompt_too_long = 0
        self.n_prompt_overflow_masked = 0
        self.n_response_truncated = 0
        self.n_no_trainable_token = 0
        self._open = False

    # ------------------------------------------------------------------ one row

    def begin(self, prompt_ids: list[int], overflow_to_response: bool = False) -> None:
        """Open a row whose prompt is ``prompt_ids`` (the prompt of the row's first call).

        A prompt longer than ``P``: with ``overflow_to_response`` its first ``P``
        tokens are the prompt and the rest opens the response with mask 0 (the
        whole context stays in ``input_ids``, none of it is trained on);
        otherwise its last ``P`` tokens are kept and the row is marked in
        ``is_drop_mask`` (the loop drops it after advantages).
        """
        assert not self._open, "end() the previous row first"
        self._open = True
        self._mark = (len(self.tokens), len(self.runs), len(self.logprobs))
        self._length = 0  # response tokens kept in this row
        self._last_model = -1  # response position of this row's last model token
        self._truncated = self._drop = self._overflowed = False
        # The response is the window of the row's last context (prompt + response) that starts here.
        self._window = len(prompt_ids)
        if len(prompt_ids) <= self.P:
            self._take(prompt_ids)
            self._prompt_len = len(prompt_ids)
        elif overflow_to_response:
            self._take(prompt_ids[: self.P])
            self._prompt_len = self._window = self.P
            self._overflowed = True
            self.add_turn(len(prompt_ids) - self.P, 0, None)
        else:
            self._take(prompt_ids[-self.P:])
            self._prompt_len = self.P
            self._drop = True

    def add_turn(self, observation_length: int, response_length: int, logprobs: list[float] | None) -> int | None:
        """Add one call to the open row: ``observation_length`` context tokens that are new since the previous
        call (response_mask 0), then the call's ``response_length`` tokens (mask 1) with their log-probs
        (None: unknown).

        Only lengths are given: the tokens are read once, from the row's last
        context, in :meth:`end`. Returns the response position of the call's
        last kept token, or None when the row had no room left for any.
        """
        room = self.R - self._length
        observation = min(observation_length, room)
        model = min(response_length, room - observation)
        if observation + model < observation_length + response_length:
            self._truncated = True
        self.runs += (observation, model)
        self._length += observation + model
        if not model:
            return None
        self._last_model = self._length - 1
        if logprobs is None:
            self.logprobs_known = False
        elif self.logprobs_known:
            self.logprobs += logprobs if model == len(logprobs) else logprobs[:model]
        return self._last_model

    def end(self, prompt_ids: list[int], response_ids: list[int], uid: str, rollout_id: str, turn_index: int,
            rewards: list[tuple[int | None, float]]) -> bool:
        """Close the row. ``prompt_ids`` + ``response_ids`` is the row's last call, whose context holds every
        token of the row; ``rewards`` are ``(response position, value)``, position None meaning the row's last
        trainable token. A row without a trainable token is discarded (returns False)."""
        assert self._open, "begin() a row first"
        self._open = False
        if self._last_model < 0:
            tokens, runs, logprobs = self._mark
            del self.tokens[tokens:], self.runs[runs:], self.logprobs[logprobs:]
            self.n_no_trainable_token += 1
            return False
        start, stop = self._window, self._window + self._length
        self._take(prompt_ids[start:stop])
        if stop > len(prompt_ids):
            self._take(response_ids[: stop - len(prompt_ids)])
        row = len(self.prompt_len)
        self.prompt_len.append(self._prompt_len)
        self.response_len.append(self._length)
        for position, value in rewards:
            self.score_row.append(row)
            self.score_pos.append(self._last_model if position is None else position)
            self.score_value.append(value)
        self.is_drop.append(self._drop)
        self.uid.append(uid)
        self.rollout_id.append(rollout_id)
        self.turn_index.append(turn_index)
        self.n_prompt_too_long += self._drop
        self.n_prompt_overflow_masked += self._overflowed
        self.n_response_truncated += self._truncated
        return True

    def _take(self, ids: list[int]) -> None:
        # One conversion per piece: C-level, and no Python list of all the batch's tokens to hold.
        self.tokens.append(np.fromiter(ids, dtype=np.int64, count=len(ids)))

    # ------------------------------------------------------------------ all rows

    def metrics(self) -> dict[str, float]:
        return {
            "training/n_triplets": float(len(self.prompt_len)),
            "training/n_triplets_prompt_too_long": float(self.n_prompt_too_long),
            "training/n_triplets_prompt_overflow_masked": float(self.n_prompt_overflow_masked),
            "training/n_triplets_response_truncated": float(self.n_response_truncated),
            "training/n_triplets_no_trainable_token": float(self.n_no_trainable_token),
        }

    def to_batch(self, pad_token_id: int = 0) -> Batch:
        """The rows as the core Batch.

        Tensors (``n`` rows, ``P`` prompt and ``R`` response columns):
        ``prompts`` (n, P) and ``responses`` (n, R) token ids, pads =
        ``pad_token_id``; ``input_ids`` (n, P+R) both side by side;
        ``attention_mask`` (n, P+R) 1 on real tokens; ``position_ids`` the
        cumulative sum of the attention mask minus one, clamped at 0 (verl's
        convention); ``response_mask`` (n, R) 1 on model tokens;
        ``token_level_scores`` (n, R) float32, the rewards at their positions;
        ``rollout_log_probs`` (n, R) float32, 0 off the model tokens, present
        only when every model token's log-prob is known; ``is_drop_mask`` (n,)
        bool. Non-tensors: ``uid`` and ``data_id`` (the group: the task id),
        ``rollout_id``, ``turn_index`` (index of the row's first call).
        """
        assert not self._open, "end() the last row first"
        P, R, n = self.P, self.R, len(self.prompt_len)
        prompt_len = np.array(self.prompt_len, dtype=np.int64)
        start = P - prompt_len  # first real column of each row
        length = prompt_len + np.array(self.response_len, dtype=np.int64)  # real tokens of each row

        # The tensors are allocated by torch and filled through NumPy views of them. NumPy would allocate
        # with madvise(MADV_HUGEPAGE), and where the kernel then compacts memory on page faults
        # (transparent_hugepage/defrag = madvise) filling a fresh array stalls: 3x slower on a 2-core box.
        position_ids = torch.empty((n, P + R), dtype=torch.int64)
        position = position_ids.numpy()
        np.subtract(np.arange(P + R), start[:, None], out=position)  # column minus the row's first real column
        attended = torch.empty((n, P + R), dtype=torch.bool)
        # 0 <= position < length in one comparison: negative positions wrap to huge unsigned values.
        np.less(position.view(np.uint64), length.view(np.uint64)[:, None], out=attended.numpy())
        # cumsum(attention_mask) - 1 clamped at 0 (verl's position ids) is the position clamped to the row:
        # 0 over the left pads, counting over the tokens, the last position over the right pads.
        np.clip(position, 0, (length - 1)[:, None], out=position)

        # Boolean assignment fills the True cells in row-major order: exactly the order the tokens were appended.
        input_ids = torch.full((n, P + R), pad_token_id, dtype=torch.int64)
        tokens = torch.empty(int(length.sum()), dtype=torch.int64)
        if self.tokens:
            np.concatenate(self.tokens, out=tokens.numpy())
        input_ids.numpy()[attended.numpy()] = tokens.numpy()
        response_mask = torch.zeros((n, R), dtype=torch.int64)
        mask_of_runs = np.tile(np.array([0, 1], dtype=np.int8), len(self.runs) // 2)
        response_mask.numpy()[attended.numpy()[:, P:]] = np.repeat(mask_of_runs, self.runs)
        scores = torch.zeros((n, R), dtype=torch.float32)
        np.add.at(scores.numpy(), (np.array(self.score_row, dtype=np.int64), np.array(self.score_pos, dtype=np.int64)),
                  np.array(self.score_value, dtype=np.float32))

        tensors = {
            "prompts": input_ids[:, :P].contiguous(),
            "responses": input_ids[:, P:].contiguous(),
            "input_ids": input_ids,
            "attention_mask": attended.long(),
            "position_ids": position_ids,
            "response_mask": response_mask,
            "token_level_scores": scores,
            "is_drop_mask": torch.tensor(self.is_drop, dtype=torch.bool),
        }
        if self.logprobs_known:
            logprobs = torch.zeros((n, R), dtype=torch.float32)
            logprobs.numpy()[response_mask.bool().numpy()] = np.fromiter(self.logprobs, dtype=np.float32,
                                                                         count=len(self.logprobs))
            tensors["rollout_log_probs"] = logprobs
        uid = np.array(self.uid, dtype=object)
        return Batch(
            tensors=tensors,
            non_tensors={"uid": uid, "data_id": uid.copy(), "rollout_id": np.array(self.rollout_id, dtype=object),
                         "turn_index": np.array(self.turn_index, dtype=np.int64)},
        )
