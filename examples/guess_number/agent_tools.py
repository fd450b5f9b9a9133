"""The guess-the-number game (``agent.py``) played with a tool, streamed: a tool-using agent trained on a CPU.

The model guesses by calling the tool ``guess(number)``; the game's reply
("higher , from 5 to 7") comes back as the tool's result, a ``tool``-role
message, and the game is won when a call names the secret. Every call is
streamed (``stream=True``, the default of most agent frameworks) and the
agent assembles the tool call from the chunks with the ``openai`` SDK's
stream helper; the gateway records each call with the same token ids as a
call not streamed.

``tool_choice`` names ``guess``: the embedded backend then starts the answer
with the opening of the call (``[guess(number=``, in the pythonic format of
the made model's chat template) and the model writes the number, as a server
with guided decoding would make it (see ``agl_core.gateway.tool_calls``). A turn
without a valid call (the model wrote no number) is answered "invalid" by
the user, as in the plain game.
"""

from __future__ import annotations

import json
import logging

from openai import DefaultHttpxClient, LengthFinishReasonError, OpenAI

from agl_core import agent, per_thread
from agl_core.data import Task
from examples.guess_number.agent import Game

GUESS = {"type": "function", "function": {
    "name": "guess", "description": "Guess the secret number.",
    "parameters": {"type": "object", "properties": {"number": {"type": "integer"}}, "required": ["number"]}}}
CALL_GUESS = {"type": "function", "function": {"name": "guess"}}

HTTP = per_thread(DefaultHttpxClient)
"""An HTTP client per worker thread, reused by its games (:func:`agl_core.per_thread` says why)."""
for _name in ("httpx", "httpx2"):  # the SDK's HTTP library: one INFO line per model call drowns the training log
    logging.getLogger(_name).setLevel(logging.WARNING)


def guessed(message) -> int | str | None:
    """The number the message's ``guess`` call names (None when it makes no call)."""
    for call in message.tool_calls or ():
        if call.function.name == "guess":
            return json.loads(call.function.arguments).get("number")
    return None


@agent("guess_number_tools")
def guess_number_tools(task: Task, llm) -> float:
    """Play one game with the ``guess`` tool; 1.0 when a call names the secret within ``max_turns`` calls."""
    spec = task.input
    game = Game(spec["low"], spec["high"], spec["secret"])
    client = OpenAI(base_url=llm.base_url, api_key=llm.api_key, http_client=HTTP(), max_retries=0)
    temperature = 0.0 if task.split == "val" else llm.sampling.get("temperature", 1.0)
    messages: list[dict] = [{"role": "user", "content": game.prompt()}]
    for _ in range(spec["max_turns"]):
        with client.chat.completions.stream(model=llm.model, messages=messages, tools=[GUESS],
                                            tool_choice=CALL_GUESS, temperature=temperature,
                                            max_tokens=spec["max_tokens"]) as stream:
            try:
                message = stream.get_final_completion().choices[0].message
            except LengthFinishReasonError as cut:  # the model wrote no call within max_tokens: its text
                message = cut.completion.choices[0].message
        number = guessed(message)
        if number is None:
            messages += [{"role": "assistant", "content": message.content or ""},
                         {"role": "user", "content": "invalid"}]
            continue
        feedback = game.play(str(number))
        if feedback is None:
            return 1.0
        call = message.tool_calls[0]
        messages += [{"role": "assistant", "content": None, "tool_calls": [
                         {"id": call.id, "type": "function",
                          "function": {"name": "guess", "arguments": call.function.arguments}}]},
                     {"role": "tool", "tool_call_id": call.id, "content": feedback}]
    return 0.0
