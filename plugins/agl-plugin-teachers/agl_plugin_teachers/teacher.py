"""The teacher's log-prob of every response token of a batch, asked of an endpoint that scores given tokens.

A ``model_path`` teacher is scored in the trainer's process
(:class:`LocalTeacher`, the embedded backend's forward pass). An endpoint
teacher (:class:`TeacherScorer`): each row's real tokens (prompt + response,
as the student saw and sampled them) go as a completions ``prompt`` of token ids with ``prompt_logprobs: 0``
(vLLM's extension; the embedded backend answers it too), ``rows_per_request``
rows per request and ``concurrency`` requests at once, each retried by the
openai client. The requests also ask ``packed_prompt_logprobs`` (the embedded
backend's extension: each row's log-probs as the base64 text of its float32
values, no JSON object per token); a server that ignores it (vLLM) answers
vLLM's per-token dictionaries, read as well. The first batch of a scorer
that checks the student's tokenizer asks the dictionaries (they hold each
token's text). The answer's log-probs of the response positions become the
column ``teacher_log_probs`` (``(rows, response_length)``, 0 past a row's
response). Any failure — an error after the retries, an answer with other
token ids or too few log-probs, a token the teacher decodes unlike the
student (another tokenizer) — raises :class:`TeacherError` naming the teacher.
"""

from __future__ import annotations

import base64
import binascii
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agl_plugin_teachers.endpoints import Served


class TeacherError(RuntimeError):
    """The teacher could not score a batch: the step fails with this, which names the teacher."""


def row_sequences(batch) -> list[tuple[list[int], int]]:
    """Per row: its real token ids (prompt then response) and how many of them are the response."""
    prompt_width = batch["prompts"].shape[1]
    mask = batch["attention_mask"].bool()
    ids = batch["input_ids"]
    return [(ids[i][mask[i]].tolist(), int(mask[i, prompt_width:].sum())) for i in range(len(batch))]


class TeacherScorer:
    """Scores batches with one teacher (:class:`Served`); ``student_tokenizer`` (optional) checks its tokens."""

    def __init__(self, served: Served, rows_per_request: int, student_tokenizer: Any | None = None):
        self.served, self.rows_per_request, self.student_tokenizer = served, rows_per_request, student_tokenizer
        self.pool = ThreadPoolExecutor(served.config.concurrency, thread_name_prefix="agl-teacher")
        self.checked_decoding = student_tokenizer is None

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.served.close()

    def score_batch(self, batch) -> tuple[torch.Tensor, dict[str, float]]:
        """``(teacher_log_probs (rows, response_length), metrics)`` of the batch's response tokens."""
        return self.score(row_sequences(batch), batch["responses"].shape[1])

    def score(self, sequences: list[tuple[list[int], int]], width: int) -> tuple[torch.Tensor, dict[str, float]]:
        """``(teacher_log_probs (rows, width), metrics)`` of the response tokens of ``sequences``."""
        start = time.perf_counter()
        chunks = [sequences[i:i + self.rows_per_request] for i in range(0, len(sequences), self.rows_per_request)]
        out = torch.zeros((len(sequences), width), dtype=torch.float32)
        packed = self.checked_decoding  # until the tokenizer is checked, the per-token answers (with the texts)
        row = 0
        for chunk, answer in zip(chunks, self.pool.map(lambda chunk: self._request(chunk, packed), chunks)):
            for (ids, n_response), choice in zip(chunk, answer):
                if "packed_prompt_logprobs" in choice:
                    out[row, :n_response] = torch.from_numpy(self._packed_logprobs(choice, ids, n_response, row))
                else:
                    out[row, :n_response] = torch.tensor(self._response_logprobs(choice, ids, n_response, row))
                row += 1
        tokens = sum(n for _, n in sequences)
        return out, {"teacher/requests": float(len(chunks)), "teacher/tokens": float(tokens),
                     "timing_s/teacher": time.perf_counter() - start}

    def _request(self, chunk: list[tuple[list[int], int]], packed: bool) -> list[dict[str, Any]]:
        served = self.served
        try:
            # The raw answer's JSON, not the client's typed objects: a row's log-probs are a dict per token, and
            # building pydantic models of them cost more than the teacher's forward pass.
            raw = served.client.completions.with_raw_response.create(
                model=served.config.model, prompt=[ids for ids, _ in chunk], max_tokens=1, temperature=0.0,
                extra_body={"prompt_logprobs": 0, **({"packed_prompt_logprobs": True} if packed else {})})
            choices = json.loads(raw.http_response.content).get("choices")
        except Exception as exc:  # noqa: BLE001 - the step fails naming the teacher
            raise TeacherError(f"the {served.name()} failed to score {len(chunk)} rows (after "
                               f"{served.config.max_retries} retries): {exc}") from exc
        if not isinstance(choices, list) or len(choices) != len(chunk) or \
                not all(isinstance(c, dict) for c in choices):
            got = len(choices) if isinstance(choices, list) else type(choices).__name__
            raise TeacherError(f"the {served.name()} answered {got} choices for {len(chunk)} prompts")
        return sorted(choices, key=lambda c: c.get("index", 0))

    def _packed_logprobs(self, choice: dict[str, Any], ids: list[int], n_response: int, row: int) -> np.ndarray:
        try:
            values = np.frombuffer(base64.b64decode(choice["packed_prompt_logprobs"], validate=True), dtype="<f4")
        except (binascii.Error, TypeError, ValueError) as exc:
            raise TeacherError(f"the {self.served.name()} answered row {row} with packed log-probs that are not "
                               f"base64 float32: {exc}") from exc
        if len(values) != len(ids) - 1:
            raise TeacherError(f"the {self.served.name()} answered row {row} with {len(values)} packed log-probs "
                               f"for {len(ids)} tokens (one per token after the first)")
        return values[len(values) - n_response:].astype(np.float32)

    def _response_logprobs(self, choice: dict[str, Any], ids: list[int], n_response: int, row: int) -> list[float]:
        name = self.served.name()
        scored = choice.get("prompt_logprobs")
        if not isinstance(scored, list) or len(scored) != len(ids):
            got = len(scored) if isinstance(scored, list) else type(scored).__name__
            raise TeacherError(f"the {name} answered row {row} with prompt_logprobs of {got} entries for "
                               f"{len(ids)} tokens: it does not score given tokens (vLLM's prompt_logprobs)")
        echoed = choice.get("prompt_token_ids")
        if echoed is not None and list(echoed) != ids:
            raise TeacherError(f"the {name} scored other token ids than row {row}'s (it re-tokenized the prompt)")
        out = []
        for position in range(len(ids) - n_response, len(ids)):
            entry = scored[position] or {}
            found = entry.get(str(ids[position]))
            if not isinstance(found, dict) or not isinstance(found.get("logprob"), int | float):
                raise TeacherError(f"the {name} gave no log-prob of token {ids[position]} at position {position} "
                                   f"of row {row}")
            if not self.checked_decoding and "decoded_token" in found:
                self._check_decoding(ids[position], found["decoded_token"])
            out.append(float(found["logprob"]))
        self.checked_decoding = True
        return out

    def _check_decoding(self, token: int, decoded: str) -> None:
        ours = self.student_tokenizer.decode([token])
        if ours != decoded:
            raise TeacherError(f"the {self.served.name()} decodes token {token} as {decoded!r}, the student as "
                               f"{ours!r}: teacher and student have different tokenizers, and a teacher's "
                               f"log-probs of the student's tokens would be of other text. Distil from a teacher "
                               f"with the student's tokenizer")


class LocalTeacher:
    """A ``model_path`` teacher scored in the trainer's process with the embedded backend's forward pass (the one
    the ``old_log_prob`` stage runs), in micro-batches of ``rows_per_forward`` rows: no HTTP, no copy of the rows
    into JSON, so the stage costs what a forward pass of the teacher costs."""

    def __init__(self, config, rows_per_forward: int):
        from agl_plugin_torch import modeling
        from agl_plugin_torch.settings import ModelConfig

        self.config, self.rows_per_forward = config, rows_per_forward
        self.model, self.tokenizer = modeling.load(
            Path(config.model_path), ModelConfig(path=config.model_path, device=config.device, dtype=config.dtype))
        self.model.requires_grad_(False)
        self.device = next(self.model.parameters()).device

    def name(self) -> str:
        return f"teacher at model_path={self.config.model_path}"

    def score_batch(self, batch) -> tuple[torch.Tensor, dict[str, float]]:
        """``(teacher_log_probs (rows, response_length), metrics)`` of the batch's response tokens."""
        from agl_plugin_torch.forward import response_logprobs

        start = time.perf_counter()
        parts = []
        try:
            with torch.no_grad():
                for first in range(0, len(batch), self.rows_per_forward):
                    rows = slice(first, first + self.rows_per_forward)
                    inputs = [batch[key][rows].to(self.device) for key in
                              ("input_ids", "attention_mask", "position_ids", "responses")]
                    parts.append(response_logprobs(self.model, *inputs)[0].float().cpu())
        except Exception as exc:  # noqa: BLE001 - the step fails naming the teacher
            raise TeacherError(f"the {self.name()} failed to score {len(batch)} rows: {exc!r}") from exc
        log_probs = torch.cat(parts) * batch["attention_mask"][:, batch["prompts"].shape[1]:].float()
        return log_probs, {"teacher/tokens": float(batch["response_mask"].sum()),
                           "timing_s/teacher": time.perf_counter() - start}

    def close(self) -> None:
        self.model = None
