"""The guess-the-number game (``agent.py``) written with the OpenAI Agents SDK (Responses API), through the gateway.

The same game, turn for turn, as the plain-``openai`` agent: an SDK
``Agent`` answers each turn, continuing the conversation on the gateway with
``previous_response_id``. The gateway's ``/v1/responses`` keeps the attempt's
responses and translates each call to the chat call the ``openai`` agent
makes, so the policy sees the same prompts, the spans hold the same token ids,
and a run of ``recipe_openai_agents.yaml`` learns as ``recipe.yaml`` does.

One thing the game must handle: its answers are one token (``max_tokens``
1), so every answer the policy does not end itself is cut at
``max_output_tokens``, which the Responses API reports as an ``incomplete``
response, and on which the SDK raises ``ModelBehaviorError`` (as it would
against OpenAI). The turn is run streamed and the answer read from the
stream's last event, which carries the whole response, complete or not; an
incomplete run is then cancelled rather than left to raise, and the stream is
read to its end either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref

from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled
from openai import AsyncOpenAI, DefaultAsyncHttpxClient

from agl_core import agent
from agl_core.data import Task
from examples.guess_number.agent import Game

set_tracing_disabled(True)  # the SDK would export its traces to OpenAI; the gateway records the calls
for _name in ("httpx", "httpx2"):  # the SDK's HTTP library: one INFO line per model call drowns the training log
    logging.getLogger(_name).setLevel(logging.WARNING)

_HTTP: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""One connection pool per event loop (each async worker has its own loop; a pool cannot cross loops)."""

ENDS = ("response.completed", "response.incomplete")


def _http():
    loop = asyncio.get_running_loop()
    client = _HTTP.get(loop)
    if client is None:
        client = _HTTP[loop] = DefaultAsyncHttpxClient()
    return client


async def answer(player: Agent, text: str, previous_response_id: str | None) -> tuple[str, str]:
    """The player's answer to ``text`` in the conversation of ``previous_response_id``, and its response id."""
    run = Runner.run_streamed(player, text, previous_response_id=previous_response_id)
    final = None
    # Read to its end, as the SDK asks also after a cancel: a stream left mid-way leaves the turn's tasks to the
    # garbage collector, on a loop that may be gone by then (asyncio's "Task was destroyed but it is pending!").
    async with contextlib.aclosing(run.stream_events()) as events:
        async for event in events:
            if final is None and event.type == "raw_response_event" and event.data.type in ENDS:
                final = event.data.response
                if final.status == "incomplete":
                    run.cancel()  # the SDK would raise ModelBehaviorError on it; the answer is all the game needs
    if final is None:
        raise RuntimeError("the response stream ended without its last event")
    return final.output_text, final.id


@agent("guess_number_openai_agents")
async def guess_number_openai_agents(task: Task, llm) -> float:
    """Play one game; 1.0 when the secret is found within ``max_turns`` answers, else 0.0."""
    spec = task.input
    game = Game(spec["low"], spec["high"], spec["secret"])
    client = AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, http_client=_http(), max_retries=0)
    temperature = 0.0 if task.split == "val" else llm.sampling.get("temperature", 1.0)
    player = Agent(name="guesser", model=OpenAIResponsesModel(model=llm.model, openai_client=client),
                   model_settings=ModelSettings(temperature=temperature, max_tokens=spec["max_tokens"]))
    text, previous = game.prompt(), None
    for _ in range(spec["max_turns"]):
        said, previous = await answer(player, text, previous)
        text = game.play(said)
        if text is None:
            return 1.0
    return 0.0
