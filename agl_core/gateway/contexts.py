"""Exact contexts: a continued conversation goes upstream as the token ids the model saw and sampled.

An agent sends its whole history as text each turn; rendered and tokenized
again, it need not be the tokens the model sampled (a reply cut by
``max_tokens`` gets its end-of-turn, a BPE merge differs, a template
re-renders tool calls), and training on the re-rendered text is training on
contexts the model never saw. So, within one attempt, the gateway keeps each
chat call's exact context: its prompt ids and the ids sampled for each
choice. A new chat call whose messages are an earlier call's messages, then
that call's reply unchanged (its text and tool calls as the gateway returned
them), then new messages, is sent upstream as a completions call whose
prompt is that context, the template's closing of the model's turn and the
ids of only the new messages (:mod:`agl_core.gateway.chat_template`). The
answer is turned back into the chat answer the agent asked for (tool calls
parsed by :mod:`agl_core.gateway.tool_calls`, as the embedded backend parses
them; per-token log-probs only when the agent asked for them); a streamed
call is streamed as it is sampled (:class:`ChatChunks`). The prompt recorded in the span is then the previous call's prompt and
response followed by new tokens: the trajectory aggregator merges the calls
into one row, and the tokens trained are the tokens sampled.

Every chat call's span says what happened (``attributes["context"]``):

``first``
    no earlier call of the attempt: the prompt was rendered from text.
``exact``
    the prompt is an earlier call's exact context plus the new messages.
``rebuilt``
    earlier calls exist but this one was sent as text
    (:mod:`agl_core.rollout.context_record` names the values);
    ``attributes["context_reason"]`` says why: the agent edited its history
    (:data:`EDITED`), started another conversation (:data:`NEW_CONVERSATION`),
    changed its tools, or the gateway could not render (no tokenizer, a
    template that re-renders the past, a request option the token path does
    not carry). Counted as ``rollout/n_context_rebuilt``.

Memory is bounded: the last ``MAX_TURNS`` calls' choices per attempt (4 bytes a token), the
``MAX_ATTEMPTS`` most recently used attempts; an attempt's contexts are
dropped when it ends (the gateway's sweeper, :mod:`agl_core.gateway.api_routes`).
Its latest call (of one choice) also keeps the text its continuation starts
from (about a byte a token).

What a call leaves for the next one (its context, that text rendered) is
kept once its answer went out (:meth:`ExactContexts.remember_later`): the
agent waits for the answer, not for the gateway's bookkeeping.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from array import array
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from agl_core.gateway.chat_template import ChatTemplate, find_template
from agl_core.gateway.streaming import dumps
from agl_core.gateway.upstream import UpstreamError
from agl_core.rollout.context_record import EDITED, EXACT, FIRST, NEW_CONVERSATION, REBUILT, TOOLS_CHANGED
from agl_core.gateway.tool_calls import (forced_function, forced_opening, offered_tools, parse_forced_call,
                                         parse_tool_calls)
from agl_core.http.rules import RequestError


MAX_TURNS = 8
"""Calls (each with all its choices) kept per attempt: an agent continues one of its latest calls (a retry, a
second conversation interleaved with the first). At 4 bytes a token, 8 contexts of 32k tokens are 1 MiB."""

RETRY_FIND_S = 60.0
"""After a policy server listed no tokenizer (not up yet, another model), how long until it is asked again."""

MAX_ATTEMPTS = 8192
"""Attempts whose contexts are kept at once; the least recently used is dropped first."""

TEXT_ONLY_OPTIONS = ("response_format", "chat_template", "chat_template_kwargs", "continue_final_message",
                     "add_generation_prompt", "documents", "functions", "function_call")
"""Chat request fields that change the rendering or the decoding in ways a token prompt cannot carry."""

CHAT_ONLY = frozenset({"messages", "tools", "tool_choice", "parallel_tool_calls", "logprobs", "top_logprobs",
                       "max_completion_tokens", "stream", "stream_options", "return_token_ids"})
"""Chat request fields that a completions request does not take (translated or dropped)."""


@dataclass
class Turn:
    """One choice of an earlier call: its request's messages (as sent, and keyed), its reply, its exact ids."""

    keys: tuple[Any, ...]
    tools_key: str
    messages: list[dict[str, Any]]
    reply_key: Any
    reply: dict[str, Any]
    context: array  # prompt ids + sampled ids
    n_sampled: int
    before: str | None = None
    """The rendering of ``messages`` and ``reply`` (the start of the next call's, :meth:`ChatTemplate.continuation`),
    made once the answer went out, when the template was known then; kept for the attempt's latest call of one
    choice only (the one an agent continues)."""
    rendered_by: ChatTemplate | None = None


@dataclass
class Plan:
    """How one chat call goes upstream: as text, or (``prompt_ids`` set) as its exact context."""

    context: str
    reason: str | None = None
    prompt_ids: list[int] | None = None
    tools: list[dict[str, Any]] | None = None
    opening: str = ""
    template: ChatTemplate | None = None
    keys: tuple[Any, ...] = ()
    tools_key: str = ""
    offered: list[dict[str, Any]] | None = None  # the call's tools, whatever the plan (``tools``: the token path's)

    @property
    def exact(self) -> bool:
        return self.prompt_ids is not None

    def attributes(self) -> dict[str, Any]:
        """The span attributes that say how the prompt was made."""
        out: dict[str, Any] = {"context": self.context}
        if self.reason is not None:
            out["context_reason"] = self.reason
        return out


class ExactContexts:
    """The exact contexts of the running attempts, and the chat templates that continue them.

    ``find`` returns the template for an upstream URL (and where it came from,
    or why there is none): blocking, called once per URL on a worker thread.
    """

    def __init__(self, find: Callable[[str], tuple[ChatTemplate | None, str]], max_turns: int = MAX_TURNS,
                 max_attempts: int = MAX_ATTEMPTS):
        self._find = find
        self.max_turns, self.max_attempts = max_turns, max_attempts
        self._turns: OrderedDict[tuple[str, str], deque[list[Turn]]] = OrderedDict()
        self._pending: dict[tuple[str, str], list[tuple[Plan, dict[str, Any], Any]]] = {}  # see remember_later
        self._templates: dict[str, tuple[asyncio.Future, float]] = {}

    @classmethod
    def for_gateway(cls, tokenizer: str | None, headers: dict[str, str] | None, timeout_s: float) -> ExactContexts:
        return cls(lambda url: find_template(tokenizer, url, headers, timeout_s))

    # ------------------------------------------------------------ attempts

    def attempts(self) -> list[tuple[str, str]]:
        return list({**self._turns, **self._pending})

    def drop(self, attempt: tuple[str, str]) -> None:
        self._turns.pop(attempt, None)
        self._pending.pop(attempt, None)

    # ------------------------------------------------------------ the call

    async def plan(self, attempt: tuple[str, str], body: dict[str, Any], upstream: str | None) -> Plan:
        """How the chat call ``body`` of ``attempt`` goes to ``upstream`` (see the module)."""
        if attempt in self._pending:
            self._remember_pending(attempt)  # the answer before this call is not kept yet: now
        keys = tuple(message_key(m) for m in body["messages"])
        try:
            tools = offered_tools(body)
        except RequestError:
            tools = None
        tools_key = json.dumps(tools, sort_keys=True) if tools else ""
        known = self._known_template(upstream)
        turns = self._turns.get(attempt)
        if not turns:
            return Plan(FIRST, keys=keys, tools_key=tools_key, offered=tools, template=known)
        self._turns.move_to_end(attempt)
        found, reason = _continued(turns, keys, tools_key)
        if found is None:
            return Plan(REBUILT, reason, keys=keys, tools_key=tools_key, offered=tools, template=known)
        rebuilt = Plan(REBUILT, keys=keys, tools_key=tools_key, offered=tools, template=known)
        option = next((key for key in TEXT_ONLY_OPTIONS if body.get(key) is not None), None)
        if option is not None:
            rebuilt.reason = f"the request sets {option!r}, which only a rendering from text honours"
            return rebuilt
        if upstream is None:
            return rebuilt  # no server: the call fails as any other
        template, why = await self._template(upstream)
        if template is None:
            rebuilt.reason = why
            return rebuilt
        try:
            function = forced_function(body, tools)
        except RequestError as exc:
            rebuilt.reason = f"tool_choice: {exc}"
            return rebuilt
        n = len(found.keys)
        sampled = found.context[len(found.context) - found.n_sampled:].tolist()
        try:
            ids = template.continuation(found.messages, found.reply, body["messages"][n + 1:], tools, sampled,
                                        before=found.before if found.rendered_by is template else None)
        except Exception as exc:  # noqa: BLE001 - a template that cannot render the request: the server says why
            rebuilt.reason = f"the chat template cannot render the new messages: {exc}"
            return rebuilt
        if ids is None:
            rebuilt.reason = "the chat template renders the history differently once new messages follow"
            return rebuilt
        opening = forced_opening(function, template.tool_format) if function is not None else ""
        prompt = found.context.tolist() + ids + (template.encode(opening) if opening else [])
        return Plan(EXACT, prompt_ids=prompt, tools=tools, opening=opening, template=template, keys=keys,
                    tools_key=tools_key, offered=tools)

    def remember_later(self, attempt: tuple[str, str], plan: Plan, body: dict[str, Any], response: Any) -> None:
        """:meth:`remember`, once the event loop is done with the call's turn (its answer written to the agent: the
        agent has it sooner); the attempt's next :meth:`plan` remembers first what is still pending. On the event
        loop only."""
        pending = self._pending.setdefault(attempt, [])
        pending.append((plan, body, response))
        if len(pending) == 1:
            asyncio.get_running_loop().call_soon(self._remember_pending, attempt)

    def _remember_pending(self, attempt: tuple[str, str]) -> None:
        for plan, body, response in self._pending.pop(attempt, ()):
            self.remember(attempt, plan, body, response)

    def remember(self, attempt: tuple[str, str], plan: Plan, body: dict[str, Any], response: Any) -> None:
        """Keep the exact context of each choice of a chat ``response`` to ``body`` (one with token ids), with the
        rendering the next call starts from when ``plan`` knows the template."""
        if not isinstance(response, dict):
            return
        top_prompt = response.get("prompt_token_ids")
        kept = []
        for choice in response.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            prompt, sampled = top_prompt or choice.get("prompt_token_ids"), choice.get("token_ids")
            message = choice.get("message")
            if prompt is None or sampled is None or not isinstance(message, dict):
                continue
            reply = {"role": "assistant", "content": message.get("content")}
            if message.get("tool_calls"):
                reply["tool_calls"] = message["tool_calls"]
            kept.append(Turn(plan.keys, plan.tools_key, body["messages"], message_key(reply), reply,
                             array("i", [*prompt, *sampled]), len(sampled)))
        if not kept:
            return
        turns = self._turns.get(attempt)
        if turns is None:
            turns = self._turns[attempt] = deque(maxlen=self.max_turns)
            while len(self._turns) > self.max_attempts:
                self._turns.popitem(last=False)
        elif turns and len(turns[-1]) == 1:
            turns[-1][0].before = turns[-1][0].rendered_by = None  # one rendered text per attempt at most
        if len(kept) == 1:
            kept[0].before, kept[0].rendered_by = _rendered(plan, body, kept[0].reply)
        turns.append(kept)

    def _known_template(self, upstream: str | None) -> ChatTemplate | None:
        """The template for ``upstream`` if it is found already (None: not looked for, not found, or not yet)."""
        found = self._templates.get(upstream) if upstream is not None else None
        if found is None or not found[0].done() or found[0].cancelled() or found[0].exception() is not None:
            return None
        return found[0].result()[0]

    async def _template(self, upstream: str) -> tuple[ChatTemplate | None, str]:
        """The template for ``upstream``, found once (a failure is looked into again after ``RETRY_FIND_S``)."""
        found = self._templates.get(upstream)
        if found is None or (found[0].done() and found[0].result()[0] is None
                             and time.monotonic() - found[1] > RETRY_FIND_S):
            found = self._templates[upstream] = (asyncio.ensure_future(asyncio.to_thread(self._find, upstream)),
                                                 time.monotonic())
        return await asyncio.shield(found[0])


def _rendered(plan: Plan, body: dict[str, Any], reply: dict[str, Any]) -> tuple[str | None, ChatTemplate | None]:
    """The rendering of ``body``'s messages and ``reply`` by ``plan``'s template, and the template; Nones when the
    plan knows none or it cannot render them (the next call then renders, and says why)."""
    if plan.template is None or any(body.get(key) is not None for key in TEXT_ONLY_OPTIONS):
        return None, None
    try:
        return plan.template.render([*body["messages"], reply], plan.offered, False), plan.template
    except Exception:  # noqa: BLE001 - a template that cannot render it: the next call's plan finds out and says why
        return None, None


def _continued(turns: deque[list[Turn]], keys: tuple[Any, ...], tools_key: str) -> tuple[Turn | None, str]:
    """The latest turn that ``keys`` continue (its messages, its reply, then at least one message), or why none."""
    reason = NEW_CONVERSATION
    for choices in reversed(turns):
        for turn in choices:
            n = len(turn.keys)
            if len(keys) > n + 1 and keys[:n] == turn.keys and keys[n] == turn.reply_key:
                if turn.tools_key != tools_key:
                    reason = TOOLS_CHANGED
                    continue
                return turn, ""
            if reason is NEW_CONVERSATION and keys[:1] == turn.keys[:1]:
                reason = EDITED
    return None, reason


def message_key(message: Any) -> Any:
    """What of a chat message the model's context depends on, comparable: role, text, name, tool calls.

    The text of a list of text parts is joined (``None`` is ``""``); tool
    calls compare by name and arguments as JSON values, not by their ids or
    their spelling (an agent may re-serialize the arguments).
    """
    if not isinstance(message, dict):
        return repr(message)
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(part.get("text", "") if isinstance(part, dict) else repr(part) for part in content)
    calls = tuple(_call_key(call) for call in message.get("tool_calls") or ())
    return (message.get("role"), content or "", message.get("name"), message.get("tool_call_id"), calls)


def _call_key(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return repr(call)
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return function.get("name"), arguments
    return function.get("name"), json.dumps(arguments, sort_keys=True)


# ------------------------------------------------------------ the token path upstream


def completion_request(body: dict[str, Any], prompt_ids: list[int]) -> dict[str, Any]:
    """The completions request that samples the chat request ``body`` from the token prompt ``prompt_ids``."""
    out = {key: value for key, value in body.items() if key not in CHAT_ONLY}
    out["prompt"] = prompt_ids
    if body.get("max_completion_tokens") is not None:
        out["max_tokens"] = body["max_completion_tokens"]
    if body.get("top_logprobs"):
        out["logprobs"] = body["top_logprobs"]
    return out


def chat_answer(response: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """A completions ``response`` to the token prompt of ``plan`` as the chat completion the agent asked for.

    Tool calls are parsed from the text as the embedded backend parses them
    (:mod:`agl_core.gateway.tool_calls`), a forced call with its opening.
    """
    choices = []
    prompt = response.get("prompt_token_ids")
    for index, choice in enumerate(response.get("choices") or ()):
        text = choice.get("text") or ""
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish_reason = choice.get("finish_reason")
        if plan.tools:
            fmt = plan.template.tool_format if plan.template is not None else ""
            message["content"], calls = (parse_forced_call(plan.opening, text, fmt, plan.tools) if plan.opening
                                         else parse_tool_calls(text, plan.tools))
            if calls:
                message["tool_calls"], finish_reason = calls, "tool_calls"
        out = {"index": choice.get("index", index), "message": message, "finish_reason": finish_reason,
               "logprobs": _chat_logprobs(choice.get("logprobs")), "token_ids": choice.get("token_ids")}
        if "stop_reason" in choice:
            out["stop_reason"] = choice["stop_reason"]
        choices.append(out)
        prompt = prompt if prompt is not None else choice.get("prompt_token_ids")
    top = {key: value for key, value in response.items() if key not in ("choices", "object", "prompt_token_ids")}
    return {**top, "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "choices": choices,
            "prompt_token_ids": prompt}


class ChatChunks:
    """A streamed completions answer to the token prompt of ``plan``, chunk by chunk as the chat chunks the agent
    asked for, in vLLM's layout (:mod:`agl_core.gateway.streaming`): per choice a first chunk with the role (the
    call's first with ``prompt_token_ids``), then the text as it comes with each chunk's token ids and log-probs.

    With tools offered the text is held, as the embedded backend holds it, and the last chunk of a choice carries
    its content and ``tool_calls`` parsed as :func:`chat_answer` parses them.
    """

    def __init__(self, plan: Plan):
        self.plan = plan
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self._texts: dict[int, list[str]] = {}  # per choice begun: the text held (tools offered)
        self._prompt_sent = False

    async def batches(self, batches: AsyncIterator[tuple[list[bytes], bool]]):
        """``batches`` of completions chunk payloads as batches of chat chunk payloads."""
        async for payloads, done in batches:
            try:
                chunks = [chunk for payload in payloads for chunk in self.chunks(json.loads(payload))]
            except (ValueError, TypeError, AttributeError) as exc:
                raise UpstreamError(f"a chunk is not a completions chunk ({exc})") from None
            yield [dumps(chunk) for chunk in chunks], done

    def chunks(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The chat chunks of one completions ``chunk``."""
        top = {key: value for key, value in chunk.items() if key not in ("choices", "object", "id")}
        top.update(id=self.id, object="chat.completion.chunk")
        prompt = top.pop("prompt_token_ids", None)
        if not chunk.get("choices"):
            return [{**top, "choices": []}]  # the usage
        out = []
        for choice in chunk["choices"]:
            index = choice.get("index", 0)
            prompt = choice.get("prompt_token_ids", prompt)
            if index not in self._texts:
                self._texts[index] = []
                first = {**top, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]}
                if not self._prompt_sent and prompt is not None:
                    first["prompt_token_ids"], self._prompt_sent = prompt, True
                out.append(first)
            text, finish_reason = choice.get("text") or "", choice.get("finish_reason")
            delta: dict[str, Any] = {}
            if not self.plan.tools:
                if text:
                    delta["content"] = text
            else:
                self._texts[index].append(text)
                if finish_reason is not None:
                    message = chat_answer({"choices": [{"text": "".join(self._texts[index])}]}, self.plan)
                    parsed = message["choices"][0]["message"]
                    if parsed.get("content"):
                        delta["content"] = parsed["content"]
                    if parsed.get("tool_calls"):
                        delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(parsed["tool_calls"])]
                        finish_reason = "tool_calls"
            made = {"index": index, "delta": delta, "logprobs": _chat_logprobs(choice.get("logprobs")),
                    "finish_reason": finish_reason}
            for key in ("token_ids", "stop_reason"):
                if key in choice:
                    made[key] = choice[key]
            out.append({**top, "choices": [made]})
        return out


def as_asked(chat: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    """A token path's ``chat`` answer with its per-token log-probs only when the agent's ``request`` asked for them.

    The span keeps them whatever the agent asked; sent back unasked they would
    be most of the answer's bytes and of the gateway's time to write it.
    """
    if request.get("logprobs"):
        return chat
    return {**chat, "choices": [{**choice, "logprobs": None} for choice in chat["choices"]]}


def _chat_logprobs(logprobs: Any) -> dict[str, Any] | None:
    """Completions log-probs (``tokens``, ``token_logprobs``, ``top_logprobs``) in the chat layout."""
    if not isinstance(logprobs, dict) or logprobs.get("token_logprobs") is None:
        return None
    values = logprobs["token_logprobs"]
    tokens = logprobs.get("tokens") or [""] * len(values)
    tops = logprobs.get("top_logprobs") or [None] * len(values)
    return {"content": [{"token": token, "logprob": value, "bytes": None,
                         "top_logprobs": [{"token": t, "logprob": lp, "bytes": None} for t, lp in (top or {}).items()]}
                        for token, value, top in zip(tokens, values, tops)]}
