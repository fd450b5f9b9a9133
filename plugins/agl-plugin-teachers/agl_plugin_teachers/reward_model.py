"""A reward model with a value head: a sequence-classification checkpoint (``num_labels`` 1) scoring transcripts,
in this process (:class:`RewardModel`) or behind an endpoint answering vLLM's pooling API
(:class:`EndpointRewardModel`; :mod:`agl_plugin_teachers.reward_server` serves one).

What verl's ``use_rm`` / ``compute_rm_score`` run: a model whose head gives
one number for a whole sequence, read at its last token. The checkpoint (a
transformers ``AutoModelForSequenceClassification`` directory, e.g. a
Skywork- or Qwen-style reward model) is loaded into the trainer's process on
the recipe's device and dtype and scores the step's transcripts
``rows_per_forward`` at a time, shortest first, in inference mode, right-padded.

Its input: with the policy's tokenizer (same vocabulary and special tokens),
the transcript's own token ids — the conversation as the policy's chat
template rendered it, exact, no re-tokenization; with another tokenizer, the
transcript decoded by the policy's tokenizer, as the assistant's message after
the task's input as the user's, rendered by the reward model's chat template
(its plain tokens when it has none). Either is cut to its last ``max_length``
tokens.

The value: a decoder's head (``score``, the transformers convention) is
applied to each row's hidden state at its own last token, so padding never
changes a score; a model with another head is run one row at a time, unpadded,
through its own forward.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from agl_plugin_teachers.settings import JudgeConfig
from agl_plugin_teachers.verdicts import Transcript, Verdict


class GarbageAnswer(ValueError):
    """A reward model's answer that holds no value for each row asked."""


class RewardInputs:
    """What a reward model reads of transcripts and how its values become verdicts, wherever it runs: the
    subclass gives ``values(rows)`` (one number per row of token ids) and ``name()``."""

    config: JudgeConfig
    policy_tokenizer: Any
    tokenizer: Any  # the reward model's own, or None: it reads the policy's token ids
    same_tokens: bool

    def set_tokenizers(self, policy_tokenizer: Any, tokenizer: Any) -> None:
        from agl_plugin_teachers.endpoints import tokenizer_fingerprint

        self.policy_tokenizer, self.tokenizer = policy_tokenizer, tokenizer
        self.same_tokens = tokenizer is None or (hasattr(policy_tokenizer, "get_vocab") and
                                                 tokenizer_fingerprint(policy_tokenizer) ==
                                                 tokenizer_fingerprint(tokenizer))

    def score(self, transcripts: list[Transcript], task_inputs: dict[str, Any]) -> list[Verdict]:
        """One verdict per transcript: its value, or why there is none."""
        inputs = [self.input_ids(t, task_inputs.get(t.task_id, {"id": t.task_id})) for t in transcripts]
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))  # rows of about one length pad little
        step = self.config.rows_per_forward
        chunks = [order[first:first + step] for first in range(0, len(order), step)]
        out: list[Verdict | None] = [None] * len(inputs)
        for chunk, values in zip(chunks, self.map_chunks([[inputs[i] for i in chunk] for chunk in chunks])):
            if isinstance(values, Exception):  # the rollouts (or turns) are marked with it
                failure = "garbage" if isinstance(values, GarbageAnswer) else "failed"
                for i in chunk:
                    out[i] = Verdict(None, failure, f"the {self.name()} failed to score {len(chunk)} "
                                                    f"transcripts: {values!r}")
                continue
            for i, value in zip(chunk, values):
                out[i] = Verdict(value, prompt_tokens=len(inputs[i])) if math.isfinite(value) else \
                    Verdict(None, "garbage", f"the {self.name()} gave the value {value}", prompt_tokens=len(inputs[i]))
        return out

    def map_chunks(self, chunks: list[list[list[int]]]) -> list[list[float] | Exception]:
        """Each chunk's values, or the exception that stopped them; one chunk after another."""
        return [self.try_values(rows) for rows in chunks]

    def try_values(self, rows: list[list[int]]) -> list[float] | Exception:
        try:
            return self.values(rows)
        except Exception as exc:  # noqa: BLE001 - returned: the caller marks the chunk's transcripts with it
            return exc

    def input_ids(self, transcript: Transcript, task_input: Any) -> list[int]:
        """What the model reads of a transcript (see the module's docstring), its last ``max_length`` tokens."""
        if self.same_tokens:
            ids = transcript.ids
        else:
            text = self.policy_tokenizer.decode(transcript.ids)
            if self.tokenizer.chat_template:
                ids = self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": json.dumps(task_input)}, {"role": "assistant", "content": text}],
                    tokenize=True, return_dict=False)
            else:
                ids = self.tokenizer(text, add_special_tokens=True)["input_ids"]
        return list(ids)[-self.config.max_length:]



class RewardModel(RewardInputs):
    """Scores transcripts with the value head of the sequence-classification model at ``config.model_path``, in
    this process. ``policy_tokenizer`` None: it reads token ids of its own tokenizer (what a server of it gets)."""

    def __init__(self, config: JudgeConfig, policy_tokenizer: Any):
        from transformers import AutoModelForSequenceClassification

        from agl_plugin_teachers.endpoints import load_tokenizer
        from agl_plugin_torch.modeling import device_and_dtype
        from agl_plugin_torch.settings import ModelConfig

        self.config = config
        self.device, dtype = device_and_dtype(ModelConfig(path=config.model_path, device=config.device,
                                                          dtype=config.dtype))
        self.model = AutoModelForSequenceClassification.from_pretrained(
            config.model_path, local_files_only=True, dtype=dtype).to(self.device).eval()
        self.model.requires_grad_(False)
        if self.model.config.num_labels != 1:
            raise ValueError(f"plugins.judge.model_path {config.model_path!r} has a head of "
                             f"{self.model.config.num_labels} labels; a reward model gives one value (num_labels 1)")
        tokenizer = load_tokenizer(config.model_path)
        self.set_tokenizers(policy_tokenizer if policy_tokenizer is not None else tokenizer, tokenizer)
        self.pad_id = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)

    def name(self) -> str:
        return f"reward model at model_path={self.config.model_path}"

    def close(self) -> None:
        self.model = None

    @torch.inference_mode()
    def values(self, rows: list[list[int]]) -> list[float]:
        """The value of each row (token ids), in one forward pass of them all."""
        model, n = self.model, len(rows)
        head = getattr(model, "score", None)
        backbone = getattr(model, model.base_model_prefix, None)
        if head is None or backbone is None:
            return [float(model(input_ids=torch.tensor([row], device=self.device)).logits[0, 0]) for row in rows]
        lengths = torch.tensor([len(row) for row in rows])
        ids = torch.full((n, int(lengths.max())), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, :len(row)] = torch.tensor(row)
            mask[i, :len(row)] = 1
        hidden = backbone(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                          use_cache=False).last_hidden_state
        last = hidden[torch.arange(n, device=self.device), (lengths - 1).to(self.device)]
        return head(last)[:, 0].float().cpu().tolist()


class EndpointRewardModel(RewardInputs):
    """A reward model behind an endpoint (``config.endpoint``) that answers vLLM's pooling API: ``POST /pooling``
    ``{"model", "input": [token ids, ...]}`` -> ``{"data": [{"index", "data": value}, ...]}``, the value a number,
    ``[value]``, or one per token (``[[v], ...]``: the last token's counts, as a value head reads it). Chunks of
    ``rows_per_forward`` rows go ``concurrency`` requests at once, each retried by the openai client."""

    def __init__(self, config: JudgeConfig, policy_tokenizer: Any):
        from agl_plugin_teachers.endpoints import Served, load_tokenizer

        self.config = config
        self.served = Served(config, "reward model")
        self.set_tokenizers(policy_tokenizer, load_tokenizer(config.reward_tokenizer) if config.reward_tokenizer
                            else None)
        self.url = pooling_url(config.endpoint)
        self.pool = ThreadPoolExecutor(config.concurrency, thread_name_prefix="agl-reward-model")

    def name(self) -> str:
        return self.served.name()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.served.close()

    def map_chunks(self, chunks: list[list[list[int]]]) -> list[list[float] | Exception]:
        return list(self.pool.map(self.try_values, chunks))

    def values(self, rows: list[list[int]]) -> list[float]:
        reply = self.served.client.post(self.url, cast_to=object,
                                        body={"model": self.config.model, "input": rows})
        return pooled_values(reply, len(rows))


def pooling_url(endpoint: str) -> str:
    """vLLM's pooling route of a server whose base URL is ``endpoint`` (with or without its ``/v1``)."""
    base = endpoint.rstrip("/")
    return (base[:-len("/v1")] if base.endswith("/v1") else base) + "/pooling"


def pooled_values(reply: Any, n: int) -> list[float]:
    """The value of each of the ``n`` rows in a pooling answer; :class:`GarbageAnswer` when it holds none."""
    data = reply.get("data") if isinstance(reply, dict) else None
    if not isinstance(data, list) or len(data) != n:
        raise GarbageAnswer(f"expected 'data' with {n} entries, got {str(reply)[:200]!r}")
    values = []
    for i, item in enumerate(sorted(data, key=lambda d: d.get("index", 0) if isinstance(d, dict) else 0)):
        value = item.get("data") if isinstance(item, dict) else None
        while isinstance(value, list) and value:  # [v] or one per token: the last
            value = value[-1]
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise GarbageAnswer(f"'data[{i}].data' holds no number: {str(item)[:200]!r}")
        values.append(float(value))
    return values
