"""The guess-the-number game (``agent.py``) written with the ``anthropic`` SDK, trained through the gateway.

The same game, turn for turn, as the plain-``openai`` agent: only the client
differs. The gateway's ``/v1/messages`` translates each call to the chat call
the ``openai`` agent makes, so the policy sees the same prompts, the spans
hold the same token ids, and a run of ``recipe_anthropic.yaml`` learns as
``recipe.yaml`` does.

What changes in an ``anthropic`` agent to train it: the base URL. The SDK
appends ``/v1/messages`` to it, so it is the attempt's base URL without its
``/v1``; the gateway reads the SDK's ``x-api-key`` header as its token.
``temperature`` goes in ``extra_body`` (``messages.create`` of the 2.x SDK
has no such argument).
"""

from __future__ import annotations

import logging

from anthropic import Anthropic, DefaultHttpxClient

from agl_core import agent, per_thread
from agl_core.data import Task
from examples.guess_number.agent import Game

HTTP = per_thread(DefaultHttpxClient)
"""An HTTP client per worker thread, reused by its games (:func:`agl_core.per_thread` says why)."""
for _name in ("httpx", "httpx2"):  # the SDK's HTTP library: one INFO line per model call drowns the training log
    logging.getLogger(_name).setLevel(logging.WARNING)


@agent("guess_number_anthropic")
def guess_number_anthropic(task: Task, llm) -> float:
    """Play one game; 1.0 when the secret is found within ``max_turns`` answers, else 0.0."""
    spec = task.input
    game = Game(spec["low"], spec["high"], spec["secret"])
    client = Anthropic(base_url=llm.base_url.removesuffix("/v1"), api_key=llm.api_key, http_client=HTTP(),
                       max_retries=0)
    temperature = 0.0 if task.split == "val" else llm.sampling.get("temperature", 1.0)
    messages = [{"role": "user", "content": game.prompt()}]
    for _ in range(spec["max_turns"]):
        reply = client.messages.create(model=llm.model, messages=messages, max_tokens=spec["max_tokens"],
                                       extra_body={"temperature": temperature})
        answer = "".join(block.text for block in reply.content if block.type == "text")
        feedback = game.play(answer)
        if feedback is None:
            return 1.0
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": feedback}]
    return 0.0
