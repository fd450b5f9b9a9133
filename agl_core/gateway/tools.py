"""The tool fields of a chat request, checked at the gateway's door.

``tools`` and ``tool_choice`` pass through to the policy server unchanged
(it renders the tools with its chat template and parses the model's calls
back into ``tool_calls``); the gateway only refuses, with a 400 naming the
field, what no OpenAI-compatible server would take, so that a bad request
fails alone and writes nothing.
"""

from __future__ import annotations

from typing import Any

from agl_core.http.rules import RequestError

TOOL_CHOICES = ("none", "auto", "required")


def check_tools(body: dict[str, Any]) -> None:
    """RequestError 400 naming the first malformed ``tools[i]`` or ``tool_choice`` of a chat request ``body``."""
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise RequestError(400, f"'tools' must be a list of tool objects, got {type(tools).__name__}")
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type", "function") != "function":
                raise RequestError(400, f"'tools[{i}]' must be a tool object of type 'function'")
            function = tool.get("function")
            if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
                raise RequestError(400, f"'tools[{i}].function.name' must be a non-empty string")
            if not isinstance(function.get("parameters", {}), dict):
                raise RequestError(400, f"'tools[{i}].function.parameters' must be a JSON schema object")
    choice = body.get("tool_choice")
    if choice is None or choice in TOOL_CHOICES:
        return
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise RequestError(400, "'tool_choice' must be 'none', 'auto', 'required' or "
                                "{'type': 'function', 'function': {'name': ...}}")
    if not any((tool.get("function") or {}).get("name") == name for tool in tools or ()):
        raise RequestError(400, f"'tool_choice' names the function {name!r:.80}, which is not in 'tools'")
