"""Tool calls in chat templates: tools rendered by the chat template, calls parsed back into ``tool_calls``.

A chat request's ``tools`` go to the tokenizer's chat template
(``apply_chat_template(..., tools=...)``) with the messages, whose
``tool_calls`` arguments are turned from JSON text into objects, as chat
templates expect; ``tool``-role messages are rendered by the template like
any other. The model writes its calls as text; :func:`parse_tool_calls` reads
them back in either of two documented formats:

- **Hermes** (Qwen2.5, Hermes, and most templates that know tools): one
  ``<tool_call>{"name": "f", "arguments": {...}}</tool_call>`` block per
  call; text outside the blocks is the message's content.
- **Pythonic** (Llama 3.2/4; the template of a model the plugin makes): the
  whole answer is a Python list of calls with keyword arguments,
  ``[f(a=1, b="x"), g()]``; only calls of offered tools count. It survives a
  word tokenizer's spaces (``[ f ( a = 1 )]``).

A block that does not parse stays text, as vLLM's parsers leave it. Which
format a model writes is its template's choice: :func:`tool_format` reads it
from the template (``<tool_call>`` in it: Hermes). A ``tool_choice`` naming a
function (or ``"required"`` with one tool) is honored the way a prefix is:
:func:`forced_opening` is the start of that call, appended to the prompt, and
the model writes the rest (its arguments); the call's text is the opening
plus what the model wrote, closed by the format's closing brackets when the
model stopped before writing them (:func:`parse_forced_call`). The model
chooses the values; the syntax around them is the backend's, as a server
with guided decoding (vLLM) guarantees a forced call's syntax.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from typing import Any

from agl_core.http.rules import RequestError

HERMES, PYTHONIC = "hermes", "pythonic"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def tool_format(chat_template: str | None) -> str:
    """The format in which a model with ``chat_template`` writes its calls (see the module)."""
    return HERMES if chat_template and "<tool_call>" in chat_template else PYTHONIC


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as chat templates take them: each tool call's ``arguments`` an object, not JSON text.

    RequestError 400 naming ``messages[i].tool_calls[j]`` when a call is malformed.
    """
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if not calls:
            out.append(message)
            continue
        if not isinstance(calls, list):
            raise RequestError(400, f"'messages[{i}].tool_calls' must be a list of tool calls")
        rendered = []
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise RequestError(400, f"'messages[{i}].tool_calls[{j}].function.name' must be a string")
            arguments = function.get("arguments") or "{}"
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    raise RequestError(400, f"'messages[{i}].tool_calls[{j}].function.arguments' is not "
                                            f"JSON: {arguments!r:.80}") from None
            if not isinstance(arguments, dict):
                raise RequestError(400, f"'messages[{i}].tool_calls[{j}].function.arguments' must be a JSON object")
            rendered.append({**call, "type": "function", "function": {"name": function["name"],
                                                                      "arguments": arguments}})
        out.append({**message, "tool_calls": rendered})
    return out


def offered_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The tools a chat request lets the model call (none when ``tool_choice`` is ``"none"``)."""
    tools = body.get("tools")
    if not tools or body.get("tool_choice") == "none":
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("function"), dict)
                                              and isinstance(t["function"].get("name"), str) for t in tools):
        raise RequestError(400, "'tools' must be a list of {'type': 'function', 'function': {'name': ...}} objects")
    return tools


def forced_function(body: dict[str, Any], tools: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """The function a request's ``tool_choice`` makes the model call, or None (``"auto"``, no tools)."""
    choice = body.get("tool_choice")
    if not tools or choice in (None, "auto", "none"):
        return None
    if choice == "required":
        if len(tools) != 1:
            raise RequestError(400, "'tool_choice': 'required' with several tools cannot be enforced by the "
                                    "embedded backend: name the function, or use 'auto'")
        return tools[0]["function"]
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    for tool in tools:
        if tool["function"]["name"] == name:
            return tool["function"]
    raise RequestError(400, f"'tool_choice' must be 'none', 'auto', 'required' or name one of 'tools', "
                            f"got {choice!r:.80}")


def forced_opening(function: dict[str, Any], fmt: str) -> str:
    """The start of a call of ``function`` in format ``fmt``, up to its first required argument's value."""
    name = function["name"]
    required = (function.get("parameters") or {}).get("required") or []
    if fmt == HERMES:
        return f'<tool_call>{{"name": "{name}", "arguments": ' + (f'{{"{required[0]}": ' if required else "")
    return f"[{name}(" + (f"{required[0]}=" if required else "")


_CLOSINGS = {PYTHONIC: ("", ")]", "]"),
             HERMES: ("", "}", "}}", "</tool_call>", "}</tool_call>", "}}</tool_call>")}


def parse_forced_call(opening: str, text: str, fmt: str,
                      tools: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]]]:
    """:func:`parse_tool_calls` of a forced call's ``opening + text``, closed when the model stopped inside it.

    The closings of ``fmt`` are tried shortest first; with none parsing, the
    answer is the text (``opening + text``) and no call.
    """
    for closing in _CLOSINGS[fmt]:
        content, calls = parse_tool_calls(opening + text + closing, tools)
        if calls:
            return content, calls
    return opening + text, []


def parse_tool_calls(text: str, tools: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of a model's answer ``text``: OpenAI tool calls in either format (see the module).

    ``content`` is the text outside the calls (None when there is none and a
    call was found); with no call found, ``text`` itself and ``[]``.
    """
    names = {tool["function"]["name"] for tool in tools}
    if "<tool_call>" in text:
        calls, rest = [], []
        last = 0
        for block in _HERMES_BLOCK.finditer(text):
            call = _hermes_call(block.group(1))
            if call is None:
                continue
            rest.append(text[last:block.start()])
            last = block.end()
            calls.append(call)
        if calls:
            content = ("".join(rest) + text[last:]).strip()
            return content or None, [_openai_call(name, arguments) for name, arguments in calls]
    calls = _pythonic_calls(text, names)
    if calls:
        return None, [_openai_call(name, arguments) for name, arguments in calls]
    return text, []


def _hermes_call(block: str) -> tuple[str, dict[str, Any]] | None:
    try:
        call = json.loads(block)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    return (call["name"], arguments) if isinstance(arguments, dict) else None


def _pythonic_calls(text: str, names: set[str]) -> list[tuple[str, dict[str, Any]]] | None:
    stripped = text.strip()
    if not (stripped.startswith("[") and stripped.endswith("]")):
        return None
    try:
        tree = ast.parse(stripped, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names
                and not node.args and all(k.arg is not None for k in node.keywords)):
            return None
        try:
            calls.append((node.func.id, {k.arg: ast.literal_eval(k.value) for k in node.keywords}))
        except ValueError:
            return None
    return calls


def _openai_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}
