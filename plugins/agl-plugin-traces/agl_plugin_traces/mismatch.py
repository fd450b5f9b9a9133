"""Why a call's prompt does not extend the previous call's context: the classes of a prefix break.

When an agent's next prompt is not ``previous prompt + previous response +
new tokens`` token for token, the trajectory aggregator starts a new row and
counts the break under one class. When the gateway recorded how it made the
call's prompt (``attributes["context"]``, :mod:`agl_core.rollout.context_record`),
the class is what it saw:

``agent_edit``
    the agent changed its history (an earlier message, the model's reply),
    changed its tools, started another conversation, or went back to an
    earlier call: a break no rendering could avoid.
``re_rendered``
    the agent's history was unchanged, but the gateway sent it as text (no
    tokenizer, a template that renders the past differently, a request option
    the token path cannot carry) and the server's rendering differs from what
    the model sampled.

Otherwise (exact contexts off, spans of an older gateway) the tokens are
compared, with the tokenizer of ``plugins.traces.tokenizer``:

``template``
    the non-special tokens still extend the context; only special tokens
    (the chat template's markers) differ, e.g. a template that renders past
    assistant turns differently from the one being generated.
``retokenization``
    the ids differ but the decoded text still extends the context's text: the
    agent sent text and the server tokenized it differently from how the
    model produced it.
``other``
    the text itself differs: the agent rewrote, truncated or summarised its
    history, or started another conversation.
``unclassified``
    no tokenizer was configured, so the break could not be told apart.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from agl_core.rollout.context_record import AGENT_REASONS, EXACT, REBUILT

CLASSES = ("agent_edit", "re_rendered", "template", "retokenization", "other", "unclassified")


class Tokenizer(Protocol):
    """What classification needs of a tokenizer (a Hugging Face tokenizer has both)."""

    all_special_ids: list[int]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def recorded_class(context: str | None, reason: str | None) -> str | None:
    """The class of a break at a call whose span says how the gateway made its prompt; None when it does not."""
    if context == EXACT:
        return "agent_edit"  # an exact continuation of another call than the previous one: the agent went back
    if context == REBUILT:
        return "agent_edit" if reason in AGENT_REASONS else "re_rendered"
    return None


def classify_break(context: list[int], prompt: list[int], tokenizer: Tokenizer | None) -> str:
    """The class (one of :data:`CLASSES`) of a ``prompt`` that does not start with ``context``, from the tokens."""
    if tokenizer is None:
        return "unclassified"
    special = set(tokenizer.all_special_ids)
    context_text_ids = [t for t in context if t not in special]
    prompt_text_ids = [t for t in prompt if t not in special]
    if prompt_text_ids[: len(context_text_ids)] == context_text_ids:
        return "template"
    context_text = tokenizer.decode(context, skip_special_tokens=True)
    if tokenizer.decode(prompt, skip_special_tokens=True).startswith(context_text):
        return "retokenization"
    return "other"


def first_difference(a: list[int], b: list[int]) -> int:
    """Index of the first position where ``a`` and ``b`` differ (the shorter length when one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def write_breaks(directory: Path, records: list[dict[str, Any]]) -> None:
    """Append ``records`` (one prefix break each) to ``directory/mismatches.jsonl``."""
    if not records:
        return
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / "mismatches.jsonl").open("a") as f:
        f.writelines(json.dumps(record) + "\n" for record in records)
