"""A reward model with a value head: a local sequence-classification checkpoint (``num_labels`` 1) scoring transcripts.

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
from typing import Any

import torch

from agl_plugin_teachers.settings import JudgeConfig
from agl_plugin_teachers.verdicts import Transcript, Verdict


class RewardModel:
    """Scores transcripts with the value head of the sequence-classification model at ``config.model_path``."""

    def __init__(self, config: JudgeConfig, policy_tokenizer: Any):
        from transformers import AutoModelForSequenceClassification

        from agl_plugin_teachers.endpoints import load_tokenizer, tokenizer_fingerprint
        from agl_plugin_torch.modeling import device_and_dtype
        from agl_plugin_torch.settings import ModelConfig

        self.config, self.policy_tokenizer = config, policy_tokenizer
        self.device, dtype = device_and_dtype(ModelConfig(path=config.model_path, device=config.device,
                                                          dtype=config.dtype))
        self.model = AutoModelForSequenceClassification.from_pretrained(
            config.model_path, local_files_only=True, dtype=dtype).to(self.device).eval()
        self.model.requires_grad_(False)
        if self.model.config.num_labels != 1:
            raise ValueError(f"plugins.judge.model_path {config.model_path!r} has a head of "
                             f"{self.model.config.num_labels} labels; a reward model gives one value (num_labels 1)")
        self.tokenizer = load_tokenizer(config.model_path)
        self.same_tokens = hasattr(policy_tokenizer, "get_vocab") and \
            tokenizer_fingerprint(policy_tokenizer) == tokenizer_fingerprint(self.tokenizer)
        self.pad_id = next((i for i in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id) if i is not None), 0)

    def name(self) -> str:
        return f"reward model at model_path={self.config.model_path}"

    def close(self) -> None:
        self.model = None

    def score(self, transcripts: list[Transcript], task_inputs: dict[str, Any]) -> list[Verdict]:
        """One verdict per transcript: its value, or why there is none."""
        inputs = [self.input_ids(t, task_inputs.get(t.task_id, {"id": t.task_id})) for t in transcripts]
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))  # rows of about one length pad little
        out: list[Verdict | None] = [None] * len(inputs)
        step = self.config.rows_per_forward
        for first in range(0, len(order), step):
            chunk = order[first:first + step]
            try:
                values = self.values([inputs[i] for i in chunk])
            except Exception as exc:  # noqa: BLE001 - the rollouts (or turns) are marked with it
                for i in chunk:
                    out[i] = Verdict(None, "failed", f"the {self.name()} failed to score {len(chunk)} "
                                                     f"transcripts: {exc!r}")
                continue
            for i, value in zip(chunk, values):
                out[i] = Verdict(value, prompt_tokens=len(inputs[i])) if math.isfinite(value) else \
                    Verdict(None, "garbage", f"the {self.name()} gave the value {value}", prompt_tokens=len(inputs[i]))
        return out

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
