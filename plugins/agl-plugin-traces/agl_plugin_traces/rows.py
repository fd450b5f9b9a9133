"""Rows → tensors: rows described by lengths and buffers, laid out as padded tensors in a few vectorised passes.

An aggregator describes each training row with :class:`RowBuilder`: the
row's prompt, then one turn per model call: how many context tokens are new
since the previous call (tool results, environment text, template tokens:
``response_mask = 0``) and how many the model produced (``response_mask =
1``, trainable). Only lengths and references to the spans' packed buffers
(:class:`~agl_core.data.TokenIds`, :class:`~agl_core.data.LogProbs`) are
recorded while the rollouts are walked: a few list appends per call.
:meth:`RowBuilder.to_batch` then works out every cut, mask and reward
position for all turns at once with whole-array operations, and copies each
row's tokens once, straight from the buffers into the output tensor, from
the row's last call, whose prompt + response holds every token of the row
(no work per token in Python, no intermediate copy).

Layout, as the reference trainer and verl expect it: each row is
``P + R`` columns, the prompt left-padded into the first ``P`` and the
response right-padded into the last ``R``.

Most of the time of :meth:`RowBuilder.to_batch` is the kernel paging in the
fresh output memory (hundreds of MB). An aggregator that knows about how
many rows it will make calls :meth:`RowBuilder.reserve` first: a helper
thread then pages in the output tensors while the aggregator walks the
rollouts in Python on the other core.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from agl_core.data import REWARD_FROM_ROLLOUT, REWARD_SOURCE_DTYPE, Batch, LogProbs, TokenIds, state_key_ids

from agl_plugin_traces.reservation import Reservation

_ORDER = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask",
          "token_level_scores", "is_drop_mask", "rollout_log_probs", "prompt_length",
          "response_length", "turn_ids")  # the order of the batch's tensors
_HEADROOM = 8  # a reservation for n rows holds n + n // _HEADROOM: rows a rollout adds (prefix breaks) still fit


@dataclass
class _Layout:
    """Where every kept row's tokens, trainable tokens and rewards go (see :meth:`RowBuilder._layout`)."""

    rows: np.ndarray  # indices of the kept rows (rows with a trainable token) among all rows
    response_len: np.ndarray  # per kept row: response tokens kept
    model_turns: np.ndarray  # turns with a kept model token, in order
    model_kept: np.ndarray  # per such turn: model tokens kept
    model_at: np.ndarray  # per such turn: flat index (kept row * R + response position) of its first model token
    score_at: np.ndarray  # flat index of each reward
    score_value: np.ndarray
    truncated: int
    logprobs_known: bool
    row_of_turn: np.ndarray  # per turn: its row among all rows
    new_row: np.ndarray  # per row: its index among the kept rows (meaningless for dropped rows)


class RowBuilder:
    """Collects rows (prompt, turns, rewards, ids) and builds the core :class:`~agl_core.data.Batch`.

    Per row: :meth:`begin`, one :meth:`add_turn` per call, then :meth:`end`.
    Responses are cut at ``max_response_length`` when the batch is laid out;
    rows left without a trainable token are dropped (counted).
    """

    def __init__(self, max_prompt_length: int, max_response_length: int):
        self.P, self.R = max_prompt_length, max_response_length
        # Per turn, all rows' turns in order: context tokens new since the previous call (mask 0), then the
        # call's own tokens (mask 1) with their log-probs (None: unknown).
        self.observation: list[int] = []
        self.response: list[int] = []
        self.logprobs: list[bytes | None] = []  # packed
        self.call_rewards: list[tuple[int, float]] = []  # (turn, the reward placed on the call's last token)
        # Per turn, what the per-call columns hold: the call's position in its trace (-1: not a call, the overflow
        # of a prompt), its reward (its own, else its rollout's), where that came from, its state key.
        self.call_turn: list[int] = []
        self.call_reward: list[float] = []
        self.call_reward_source: list[str] = []
        self.call_state_key: list[str | None] = []
        # Per row. The prompt: ``prompt_len`` ids of ``prompt_src`` (the packed prompt of the row's first call)
        # from id ``prompt_from``. The response: a window of the row's last call's prompt (``context_prompt``)
        # + response (``context_response``) from id ``window``. Its turns: ``first_turn`` up to the next row's.
        self.first_turn: list[int] = []
        self.prompt_src: list[bytes] = []
        self.prompt_from: list[int] = []
        self.prompt_len: list[int] = []
        self.window: list[int] = []
        self.context_prompt: list[bytes] = []
        self.context_response: list[bytes] = []
        self.reward: list[float] = []  # the row's reward when none of its calls has its own
        self.is_drop: list[bool] = []
        self.overflowed: list[bool] = []
        self.uid: list[str] = []
        self.rollout_id: list[str] = []
        self.turn_index: list[int] = []
        self._open = False
        self._laid_out: _Layout | None = None
        self._reservation: Reservation | None = None

    def reserve(self, n_rows: int) -> None:
        """Start paging in the output tensors for about ``n_rows`` rows on a helper thread (:mod:`.reservation`).

        Call before adding rows. There is room for ``n_rows`` plus an eighth
        (rows that prefix breaks add); a batch that does not fit gets fresh
        tensors. Pages that are never written stay unmapped.
        """
        self._reservation = Reservation(self._columns(), n_rows + n_rows // _HEADROOM)

    def _columns(self) -> dict[str, tuple[int, torch.dtype]]:
        """The (n, width) output tensors: width and dtype."""
        P, R = self.P, self.R
        return {"input_ids": (P + R, torch.int64), "attention_mask": (P + R, torch.int64),
                "position_ids": (P + R, torch.int64), "response_mask": (R, torch.int64),
                "token_level_scores": (R, torch.float32), "rollout_log_probs": (R, torch.float32),
                "turn_ids": (R, torch.int32)}

    def _outputs(self, n: int) -> dict[str, torch.Tensor]:
        """Uninitialised output tensors for the batch's ``n`` rows: the reserved ones when they fit, else fresh."""
        reserved = self._reservation.claim(n) if self._reservation is not None else None
        self._reservation = None
        if reserved is not None:
            return reserved
        return {name: torch.empty((n, width), dtype=dtype) for name, (width, dtype) in self._columns().items()}

    # ------------------------------------------------------------------ one row

    def begin(self, prompt_ids: TokenIds, overflow_to_response: bool = False) -> None:
        """Open a row whose prompt is ``prompt_ids`` (the prompt of the row's first call).

        A prompt longer than ``P``: with ``overflow_to_response`` its first ``P``
        tokens are the prompt and the rest opens the response with mask 0 (the
        whole context stays in ``input_ids``, none of it is trained on);
        otherwise its last ``P`` tokens are kept and the row is marked in
        ``is_drop_mask`` (the loop drops it after advantages).
        """
        assert not self._open, "end() the previous row first"
        self._open = True
        self._laid_out = None
        packed = prompt_ids.packed
        n, P = len(prompt_ids), self.P
        self.first_turn.append(len(self.response))
        self.prompt_src.append(packed)
        overflow = n > P and overflow_to_response
        drop = n > P and not overflow_to_response
        self.prompt_from.append(n - P if drop else 0)
        self.prompt_len.append(P if n > P else n)
        # The response is the window of the row's last context (prompt + response) that starts here.
        self.window.append(P if overflow else n)
        self.is_drop.append(drop)
        self.overflowed.append(overflow)
        if overflow:
            self.add_turn(n - P, 0, None)

    def add_turn(self, observation_length: int, response_length: int, logprobs: LogProbs | None,
                 reward: float | None = None, *, turn: int = -1, call_reward: float = math.nan,
                 reward_source: str = REWARD_FROM_ROLLOUT, state_key: str | None = None) -> None:
        """Add one call to the open row: ``observation_length`` context tokens that are new since the previous
        call (response_mask 0), then the call's ``response_length`` tokens (mask 1) with their log-probs
        (None: unknown). ``reward``: a score placed on the call's last kept token (on the row's last
        trainable token when the row had no room left for any of its tokens).

        The per-call columns: ``turn``, the call's position in its trace (its tokens' ``turn_ids``; -1 for
        context that no call produced); ``call_reward``, its own reward, else its rollout's;
        ``reward_source``, where it comes from (:data:`agl_core.data.CALL_COLUMNS`); ``state_key``, the state
        it was made in (None: not given).

        Only lengths are given: the tokens are read once, from the row's last context, in :meth:`to_batch`.
        """
        if reward is not None:
            self.call_rewards.append((len(self.response), reward))
        self.observation.append(observation_length)
        self.response.append(response_length)
        self.logprobs.append(None if logprobs is None else logprobs.packed)
        self.call_turn.append(turn)
        self.call_reward.append(call_reward)
        self.call_reward_source.append(reward_source)
        self.call_state_key.append(state_key)

    def end(self, prompt_ids: TokenIds, response_ids: TokenIds, uid: str, rollout_id: str, turn_index: int,
            reward: float) -> None:
        """Close the row. ``prompt_ids`` + ``response_ids`` is the row's last call, whose context holds every
        token of the row; ``reward`` goes on the row's last trainable token when none of its calls had its own."""
        assert self._open, "begin() a row first"
        self._open = False
        self.context_prompt.append(prompt_ids.packed)
        self.context_response.append(response_ids.packed)
        self.reward.append(reward)
        self.uid.append(uid)
        self.rollout_id.append(rollout_id)
        self.turn_index.append(turn_index)

    # ------------------------------------------------------------------ all rows

    def _layout(self) -> _Layout:
        """Cut every row's response at ``R``, find its trainable tokens and its reward positions: all turns at once."""
        assert not self._open, "end() the last row first"
        if self._laid_out is not None:
            return self._laid_out
        R, n_rows, n_turns = self.R, len(self.first_turn), len(self.response)
        first_turn = np.array(self.first_turn, dtype=np.int64)
        turns_per_row = np.diff(first_turn, append=n_turns)
        row_of_turn = np.repeat(np.arange(n_rows), turns_per_row)
        # Runs, two per turn: (observation, mask 0), (response, mask 1); each one's start within its row's response.
        runs = np.empty(2 * n_turns, dtype=np.int64)
        runs[0::2], runs[1::2] = self.observation, self.response
        ends = np.cumsum(runs)
        row_start = np.zeros(n_rows, dtype=np.int64)
        has_turns = turns_per_row > 0
        row_start[has_turns] = ends[2 * first_turn[has_turns]] - runs[2 * first_turn[has_turns]]
        start = ends - runs - np.repeat(row_start, 2 * turns_per_row)
        kept = np.clip(R - start, 0, runs)  # what fits before column R
        response_len = np.zeros(n_rows, dtype=np.int64)
        np.add.at(response_len, np.repeat(row_of_turn, 2), kept)
        truncated = np.zeros(n_rows, dtype=bool)
        truncated[np.repeat(row_of_turn, 2)[kept < runs]] = True
        model_kept, model_start = kept[1::2], start[1::2]
        model_turns = np.flatnonzero(model_kept)
        # The last trainable token of each row (-1: none, the row is dropped): its last turn with a kept model token.
        last = np.full(n_rows, -1, dtype=np.int64)
        model_row = row_of_turn[model_turns]
        final = np.append(model_row[1:] != model_row[:-1], True)[: len(model_row)]  # each row's last such turn
        last[model_row[final]] = (model_start + model_kept - 1)[model_turns[final]]
        rows = np.flatnonzero(last >= 0)
        new_row = np.cumsum(last >= 0) - 1  # index among the kept rows

        # Rewards: the calls' own on their last kept token (the row's last trainable token when none was kept);
        # a row without any gets its own reward on its last trainable token.
        reward_row, reward_pos, reward_value = [], [], []
        own = np.zeros(n_rows, dtype=bool)
        if self.call_rewards:
            turn, value = (np.array(column) for column in zip(*self.call_rewards))
            row = row_of_turn[turn]
            own[row] = True
            has_room = model_kept[turn] > 0
            reward_row.append(row)
            reward_pos.append(np.where(has_room, model_start[turn] + model_kept[turn] - 1, last[row]))
            reward_value.append(value.astype(np.float64))
        plain = np.flatnonzero(~own)
        reward_row.append(plain)
        reward_pos.append(last[plain])
        reward_value.append(np.array(self.reward, dtype=np.float64)[plain])
        reward_row, reward_pos, reward_value = (np.concatenate(x) for x in (reward_row, reward_pos, reward_value))
        scored = last[reward_row] >= 0  # rewards of dropped rows go with them
        score_at = new_row[reward_row[scored]] * R + reward_pos[scored]

        known = None not in map(self.logprobs.__getitem__, model_turns.tolist())
        self._laid_out = _Layout(
            rows=rows, response_len=response_len[rows], model_turns=model_turns,
            model_kept=model_kept[model_turns], model_at=new_row[model_row] * R + model_start[model_turns],
            score_at=score_at, score_value=reward_value[scored], truncated=int(truncated[rows].sum()),
            logprobs_known=known, row_of_turn=row_of_turn, new_row=new_row)
        return self._laid_out

    def metrics(self) -> dict[str, float]:
        layout = self._layout()
        rows = layout.rows
        return {
            "training/n_triplets": float(len(rows)),
            "training/n_triplets_prompt_too_long": float(np.array(self.is_drop, dtype=bool)[rows].sum()),
            "training/n_triplets_prompt_overflow_masked": float(np.array(self.overflowed, dtype=bool)[rows].sum()),
            "training/n_triplets_response_truncated": float(layout.truncated),
            "training/n_triplets_no_trainable_token": float(len(self.first_turn) - len(rows)),
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
        bool; ``prompt_length`` and ``response_length`` (n,) float32 (the type
        verl's metrics give them), the row's real tokens on either side: verl's
        metrics read these columns when present instead of counting
        ``attention_mask``, and so does the loop; ``turn_ids`` (n, R) int32,
        on each model token the position in the trace of its call, -1
        elsewhere. Non-tensors: ``uid`` and ``data_id`` (the group: the task
        id), ``rollout_id``, ``turn_index`` (as given to :meth:`end`: the
        aggregators give the position in the trace of the row's first call),
        and the per-call columns ``call_turns``, ``call_rewards``,
        ``call_reward_sources``, ``call_state_keys``, ``call_state_ids`` (see
        :data:`agl_core.data.CALL_COLUMNS`).
        """
        layout = self._layout()
        rows = layout.rows
        # Two independent halves of about equal size: the token ids, log-probs and response mask (where the model
        # spoke), and the attention mask, position ids and scores (from the row lengths). Most of their time is the
        # kernel mapping fresh pages for 10-500 MB of output, which two threads do side by side; NumPy and
        # torch release the GIL while they fill arrays. One thread when torch is limited to one.
        out = self._outputs(len(rows))
        if torch.get_num_threads() > 1 and len(rows):
            with ThreadPoolExecutor(1, thread_name_prefix="agl-traces-rows") as helper:
                masks = helper.submit(self._masks, layout, out)
                tensors = self._tokens(layout, out, pad_token_id)
                tensors.update(masks.result())
        else:
            tensors = {**self._tokens(layout, out, pad_token_id), **self._masks(layout, out)}
        tensors["is_drop_mask"] = torch.from_numpy(np.array(self.is_drop, dtype=bool)[rows])
        tensors["prompt_length"] = torch.from_numpy(np.array(self.prompt_len, dtype=np.float32)[rows])
        tensors["response_length"] = torch.from_numpy(layout.response_len.astype(np.float32))
        tensors = {name: tensors[name] for name in _ORDER if name in tensors}
        uid = np.array(self.uid, dtype=object)[rows]
        return Batch(
            tensors=tensors,
            non_tensors={"uid": uid, "data_id": uid.copy(), "rollout_id": np.array(self.rollout_id, dtype=object)[rows],
                         "turn_index": np.array(self.turn_index, dtype=np.int64)[rows], **self._call_columns(layout)},
        )

    def _call_columns(self, layout: _Layout) -> dict[str, np.ndarray]:
        """The per-call columns (:data:`agl_core.data.CALL_COLUMNS`): ``(rows, C)`` arrays, C the most calls of a
        kept row, each row's calls from column 0 in call order, the rest padding."""
        turn = np.array(self.call_turn, dtype=np.int64)
        calls = np.flatnonzero(turn >= 0)
        kept = np.zeros(len(self.first_turn), dtype=bool)
        kept[layout.rows] = True
        calls = calls[kept[layout.row_of_turn[calls]]]
        row = layout.new_row[layout.row_of_turn[calls]]
        n = len(layout.rows)
        per_row = np.bincount(row, minlength=n)
        width = int(per_row.max()) if n else 0
        column = np.arange(len(calls)) - np.repeat(np.cumsum(per_row) - per_row, per_row)  # rank within the row
        turns = np.full((n, width), -1, dtype=np.int64)
        rewards = np.full((n, width), np.nan, dtype=np.float64)
        sources = np.full((n, width), "", dtype=REWARD_SOURCE_DTYPE)
        state_keys = np.full((n, width), None, dtype=object)
        turns[row, column] = turn[calls]
        rewards[row, column] = np.array(self.call_reward, dtype=np.float64)[calls]
        sources[row, column] = np.array(self.call_reward_source, dtype=REWARD_SOURCE_DTYPE)[calls]
        keys = self.call_state_key
        state_keys[row, column] = np.fromiter((keys[i] for i in calls.tolist()), dtype=object, count=len(calls))
        state_ids = np.full((n, width), -1, dtype=np.int64)
        state_ids[row, column] = state_key_ids(state_keys[row, column])
        return {"call_turns": turns, "call_rewards": rewards, "call_reward_sources": sources,
                "call_state_keys": state_keys, "call_state_ids": state_ids}

    # The tensors are allocated by torch and filled through NumPy views of them. NumPy would allocate
    # with madvise(MADV_HUGEPAGE), and where the kernel then compacts memory on page faults
    # (transparent_hugepage/defrag = madvise) filling a fresh array stalls: 3x slower on a 2-core box.

    def _tokens(self, layout: _Layout, out: dict[str, torch.Tensor], pad_token_id: int) -> dict[str, torch.Tensor]:
        """``input_ids``, ``prompts`` and ``responses`` (views of it), ``response_mask`` and, when known,
        ``rollout_log_probs``, written into ``out``'s uninitialised tensors."""
        P = self.P
        # Every model token's flat index in the (n, R) response tensors, in the order of the turns.
        kept = layout.model_kept
        first = np.cumsum(kept) - kept  # index of each turn's first token among all model tokens
        model_at = np.arange(int(kept.sum()), dtype=np.int64) + np.repeat(layout.model_at - first, kept)
        input_ids = out["input_ids"].fill_(pad_token_id)
        self._copy_tokens(input_ids, layout.rows.tolist(), layout.response_len.tolist())
        # prompts and responses are the two sides of input_ids, as they are in every row of verl's batch:
        # views, not copies (80 MB fewer fresh pages for a 4,096-rollout batch).
        tensors = {"prompts": input_ids[:, :P], "responses": input_ids[:, P:], "input_ids": input_ids}
        response_mask = out["response_mask"].zero_()
        response_mask.numpy().reshape(-1)[model_at] = 1
        tensors["response_mask"] = response_mask
        turn_ids = out["turn_ids"].fill_(-1)
        turn_ids.numpy().reshape(-1)[model_at] = np.repeat(np.array(self.call_turn, dtype=np.int32)[layout.model_turns],
                                                           kept)
        tensors["turn_ids"] = turn_ids
        if layout.logprobs_known:
            logprobs = out["rollout_log_probs"].zero_()
            logprobs.numpy().reshape(-1)[model_at] = self._model_logprobs(layout)
            tensors["rollout_log_probs"] = logprobs
        return tensors

    def _masks(self, layout: _Layout, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``attention_mask``, ``position_ids`` and ``token_level_scores``, written into ``out``'s uninitialised
        tensors."""
        P, R = self.P, self.R
        prompt_len = np.array(self.prompt_len, dtype=np.int64)[layout.rows]
        start = P - prompt_len  # first real column of each row
        length = prompt_len + layout.response_len  # real tokens of each row
        position_ids = torch.sub(torch.arange(P + R), torch.from_numpy(start)[:, None],  # column - first real column
                                 out=out["position_ids"])
        # 0 <= position < length in one comparison: negative positions wrap to huge unsigned values.
        attended = np.less(position_ids.numpy().view(np.uint64), length.view(np.uint64)[:, None])
        attention_mask = out["attention_mask"].copy_(torch.from_numpy(attended))
        # cumsum(attention_mask) - 1 clamped at 0 (verl's position ids) is the position clamped to the row:
        # 0 over the left pads, counting over the tokens, the last position over the right pads.
        position_ids.clamp_(min=torch.zeros((), dtype=torch.int64), max=torch.from_numpy(length - 1)[:, None])
        scores = out["token_level_scores"].zero_()
        np.add.at(scores.numpy().reshape(-1), layout.score_at, layout.score_value.astype(np.float32))
        return {"attention_mask": attention_mask, "position_ids": position_ids, "token_level_scores": scores}

    def _model_logprobs(self, layout: _Layout) -> np.ndarray:
        """The log-probs of the kept model tokens, in order: one join of the spans' packed buffers."""
        logprobs, response = self.logprobs, self.response
        turns = layout.model_turns.tolist()
        values = np.frombuffer(b"".join(map(logprobs.__getitem__, turns)), dtype=np.float64)
        if len(values) == int(layout.model_kept.sum()):
            return values  # no call was cut
        full = np.array([response[t] for t in turns], dtype=np.int64)
        # Some calls were cut: keep the first ``kept`` of each call's ``full`` log-probs.
        offset = np.repeat(np.cumsum(full) - full, layout.model_kept)
        within = np.arange(len(offset)) - np.repeat(np.cumsum(layout.model_kept) - layout.model_kept, layout.model_kept)
        return values[offset + within]

    def _copy_tokens(self, input_ids: torch.Tensor, rows: list[int], response_len: list[int]) -> None:
        """Copy every kept row's tokens from the spans' packed buffers into ``input_ids`` (n, P+R), a few memcpy
        per row: the kept prompt right-aligned in the first ``P`` columns, the response window from column ``P``."""
        if not input_ids.numel():
            return
        item = TokenIds.itemsize  # bytes per token id, in the spans' buffers and in the int64 tensor alike
        P, width = self.P, input_ids.shape[1] * item
        out = memoryview(input_ids.numpy()).cast("B")  # the tensor's bytes, row after row
        prompt_src, prompt_from, prompt_len = self.prompt_src, self.prompt_from, self.prompt_len
        context_prompt, context_response, window = self.context_prompt, self.context_response, self.window
        at_row = 0
        for row, n_response in zip(rows, response_len):
            n_prompt, first = prompt_len[row] * item, prompt_from[row] * item
            at = at_row + P * item - n_prompt
            out[at: at + n_prompt] = memoryview(prompt_src[row])[first: first + n_prompt]
            context = context_prompt[row]
            at, start = at_row + P * item, window[row] * item
            stop = start + n_response * item
            if start < len(context):  # the window starts in the call's prompt ...
                part = memoryview(context)[start: stop]
                out[at: at + len(part)] = part
                at += len(part)
            if stop > len(context):  # ... and may run into its response
                part = memoryview(context_response[row])[max(start - len(context), 0): stop - len(context)]
                out[at: at + len(part)] = part
            at_row += width
