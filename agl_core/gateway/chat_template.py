"""The policy's chat template at the gateway: the token ids of the messages that follow an exact context.

The gateway sends a continued conversation upstream as token ids
(:mod:`agl_core.gateway.contexts`): the previous call's prompt, the tokens
the model sampled, then the ids of only the messages added since. Those ids
are rendered here by the policy's own chat template, as a difference of two
renderings: the conversation up to the model's reply (``before``) and the
whole conversation with the generation prompt (``after``). When ``before``
is a prefix of ``after`` the new text is ``after[len(before):]``; when it is
not (a template that renders past turns differently once a turn follows)
there is no exact continuation and the call goes as text.

The model's turn is closed the way the template closes it: the template's
closing of an assistant turn (``<|im_end|>\\n`` for ChatML) minus the part
the model sampled itself (its end-of-turn token), all of it when the model
was cut off (``max_tokens``, a stop string).

The tokenizer comes from the recipe (``rollout.gateway.tokenizer``) or, by
default, from the policy server: the ``root`` that its ``GET /v1/models``
reports (vLLM reports the model's path there, the embedded backend its model
directory), loaded when it is a local directory. The gateway then renders
with the very files the server renders with.
"""

from __future__ import annotations

import json
import logging
import urllib.request
from pathlib import Path
from typing import Any

from agl_core.gateway.tool_calls import template_messages, tool_format

try:  # transformers' compilation of a chat template (its filters and globals), cached per template text
    from transformers.utils.chat_template_utils import _compile_jinja_template as _compile
except ImportError:  # a transformers without it: apply_chat_template renders
    _compile = None

log = logging.getLogger("agl_core.gateway")

_MARK = "AGLREPLYMARK"
"""A stand-in reply whose rendering shows where the template closes an assistant turn."""


class ChatTemplate:
    """A Hugging Face tokenizer's chat template, rendering continuations as token ids."""

    def __init__(self, tokenizer: Any, source: str = ""):
        self.tokenizer = tokenizer
        self.source = source
        self.tool_format = tool_format(tokenizer.chat_template)
        self._closings: dict[str, list[int]] = {}
        self._special = dict(tokenizer.special_tokens_map)  # the template's variables besides the messages
        self._renderers: dict[bool, tuple[Any, dict[str, Any]]] = {}
        # A fast tokenizer's Rust core encodes the same ids without the Python wrapper's ~20 µs a call.
        self._core = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None

    @classmethod
    def load(cls, path: str) -> ChatTemplate:
        """The tokenizer saved in the local directory ``path`` (nothing is downloaded)."""
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        if _saved_class(path) in GENERIC_FAST:
            # Saved as the generic fast tokenizer (the embedded backend's made word tokenizer): load it as that.
            # AutoTokenizer would go by the model's type and, for a qwen2 model, swap in Qwen2's own tokenizer,
            # whose ids are not the policy server's.
            tokenizer = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
        else:
            try:
                tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            except (ValueError, KeyError, OSError):
                # A tokenizer that AutoTokenizer does not map: the generic fast one.
                tokenizer = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer in {path} has no chat template")
        return cls(tokenizer, path)

    def encode(self, text: str) -> list[int]:
        """``text`` as ids, without the tokenizer's own BOS/EOS (the template writes what it wants)."""
        if self._core is not None:
            return self._core.encode(text, add_special_tokens=False).ids
        return self.tokenizer.encode(text, add_special_tokens=False)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, generation: bool) -> str:
        """The text of ``messages`` as ``apply_chat_template(..., tokenize=False)`` renders it: by the template
        transformers compiles, with the variables apply_chat_template gives it, but without the work both redo on
        each call (the wrapper's, and merging the template's globals into a new context: most of a render's time)."""
        if _compile is None:
            return self.tokenizer.apply_chat_template(template_messages(messages), tools=tools,
                                                      add_generation_prompt=generation, tokenize=False)
        compiled, variables = self._renderer(tools is not None)
        context = compiled.new_context({**variables, "messages": template_messages(messages), "tools": tools,
                                        "documents": None, "add_generation_prompt": generation}, shared=True)
        return compiled.environment.concat(compiled.root_render_func(context))

    def _renderer(self, with_tools: bool) -> tuple[Any, dict[str, Any]]:
        """The compiled template (the one for tools when ``with_tools``: a tokenizer may have both) and its fixed
        variables: its globals (``raise_exception``, ...) and the special tokens, as ``Template.render`` merges
        them."""
        renderer = self._renderers.get(with_tools)
        if renderer is None:
            compiled = _compile(self.tokenizer.get_chat_template(None, [] if with_tools else None))
            renderer = self._renderers[with_tools] = (compiled, {**compiled.globals, **self._special})
        return renderer

    def continuation(self, history: list[dict[str, Any]], reply: dict[str, Any], new: list[dict[str, Any]],
                     tools: list[dict[str, Any]] | None, sampled: list[int],
                     before: str | None = None) -> list[int] | None:
        """The ids after ``sampled`` (the model's reply to ``history``): the turn's closing, ``new``, the
        generation prompt; None when the template renders ``history + reply`` differently once ``new`` follows.
        ``before``: ``history + reply`` rendered by this template with ``tools`` already, when it was."""
        if before is None:
            before = self.render([*history, reply], tools, False)
        after = self.render([*history, reply, *new], tools, True)
        if not after.startswith(before):
            return None
        closing = self._closing(tools)
        return closing[_overlap(sampled, closing):] + self.encode(after[len(before):])

    def _closing(self, tools: list[dict[str, Any]] | None) -> list[int]:
        """The ids the template writes after an assistant turn's content (cached per tool set)."""
        key = json.dumps(tools, sort_keys=True) if tools else ""
        closing = self._closings.get(key)
        if closing is None:
            text = self.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": _MARK}],
                               tools, False)
            closing = self._closings[key] = self.encode(text[text.rindex(_MARK) + len(_MARK):])
        return closing


def _overlap(sampled: list[int], closing: list[int]) -> int:
    """The length of the longest start of ``closing`` that ``sampled`` ends with (the end of turn it sampled)."""
    for k in range(min(len(sampled), len(closing)), 0, -1):
        if sampled[-k:] == closing[:k]:
            return k
    return 0


def served_root(base_url: str, headers: dict[str, str] | None, timeout_s: float) -> str | None:
    """The ``root`` of the first model ``GET {base_url}/models`` lists (vLLM: the model's path); None if none."""
    request = urllib.request.Request(f"{base_url}/models", headers=headers or {})
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:  # noqa: S310 - the run's own policy server
        models = json.loads(answer.read())
    for model in models.get("data") or ():
        if isinstance(model, dict) and isinstance(model.get("root"), str):
            return model["root"]
    return None


def find_template(setting: str | None, base_url: str, headers: dict[str, str] | None,
                  timeout_s: float) -> tuple[ChatTemplate | None, str]:
    """The chat template to render continuations with, and where it came from (or why there is none).

    ``setting`` (``rollout.gateway.tokenizer``) wins; otherwise the policy
    server's ``root`` when it is a local directory. Blocking (a request and
    a tokenizer load): run off the event loop.
    """
    template, said = _find_template(setting, base_url, headers, timeout_s)
    if template is None:
        log.warning("exact contexts: %s; calls that continue a conversation go to %s as text "
                    "(rollout/n_context_rebuilt counts them)", said, base_url)
    return template, said


def _find_template(setting: str | None, base_url: str, headers: dict[str, str] | None,
                   timeout_s: float) -> tuple[ChatTemplate | None, str]:
    path = setting
    if path is None:
        try:
            path = served_root(base_url, headers, timeout_s)
        except Exception as exc:  # noqa: BLE001 - no tokenizer means text, counted; the call goes on
            return None, f"the policy server {base_url} does not list its model ({exc})"
        if path is None or not Path(path).is_dir():
            return None, (f"the policy server {base_url} names no local model directory (root {path!r}); "
                          f"set rollout.gateway.tokenizer")
    try:
        return ChatTemplate.load(path), f"tokenizer {path}"
    except Exception as exc:  # noqa: BLE001 - as above
        return None, f"cannot load a tokenizer with a chat template from {path}: {exc}"


GENERIC_FAST = ("TokenizersBackend", "PreTrainedTokenizerFast")
"""The ``tokenizer_class`` names (transformers 5's and 4's) of the generic fast tokenizer."""


def _saved_class(path: str) -> str | None:
    """The ``tokenizer_class`` the tokenizer in ``path`` was saved as (its ``tokenizer_config.json``), if any."""
    config = Path(path) / "tokenizer_config.json"
    try:
        return json.loads(config.read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        return None
