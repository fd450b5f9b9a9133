"""The guess-the-number agent: a multi-turn game played through the plain ``openai`` client.

The model is asked for a number in a range ("guess a number from 1 to 7").
Each turn the agent reads the first whole number in the model's answer; if
it is the secret the game is won, otherwise the agent replies whether the
secret is higher or lower and which range is still open ("higher , from 5
to 7"), or "invalid" when the answer holds no number. The agent returns 1.0
when a turn hits the secret and 0.0 when the turns run out.

Validation games are played greedily (temperature 0), as verl validates;
training games use the recipe's sampling (``llm.sampling``).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from openai import DefaultHttpxClient, OpenAI

from agl_core import agent, per_thread
from agl_core.data import Task

NUMBER = re.compile(r"-?\d+")

HTTP = per_thread(DefaultHttpxClient)
"""An HTTP client per worker thread, reused by its games: a client per game costs ~20 ms to make (more than
all the game's model calls), and one shared by every thread makes them queue on its pool's lock
(:func:`agl_core.per_thread`)."""
for _name in ("httpx", "httpx2"):  # the openai client's HTTP library (httpx2 from openai 3)
    logging.getLogger(_name).setLevel(logging.WARNING)  # one INFO line per model call drowns the training log


def first_number(text: str) -> int | None:
    """The first whole number written in ``text``, or None."""
    found = NUMBER.search(text)
    return int(found.group()) if found else None


@dataclass
class Game:
    """The environment: a secret in ``[low, high]`` and the range the guesses so far leave open."""

    low: int
    high: int
    secret: int

    def prompt(self) -> str:
        return f"guess a number from {self.low} to {self.high}"

    def play(self, answer: str) -> str | None:
        """None when ``answer`` names the secret; otherwise the reply, with the range narrowed by the guess."""
        guess = first_number(answer)
        if guess == self.secret:
            return None
        if guess is None:
            return "invalid"
        if self.secret > guess:
            self.low = max(self.low, guess + 1)
            return f"higher , from {self.low} to {self.high}"
        self.high = min(self.high, guess - 1)
        return f"lower , from {self.low} to {self.high}"


def start(task: Task, llm) -> tuple[Game, OpenAI, float, list[dict]]:
    """A new game of ``task``: the game, a client of ``llm``, the temperature (0 for validation), the first message."""
    spec = task.input
    game = Game(spec["low"], spec["high"], spec["secret"])
    client = OpenAI(base_url=llm.base_url, api_key=llm.api_key, http_client=HTTP(), max_retries=0)
    temperature = 0.0 if task.split == "val" else llm.sampling.get("temperature", 1.0)
    return game, client, temperature, [{"role": "user", "content": game.prompt()}]


@agent("guess_number")
def guess_number(task: Task, llm) -> float:
    """Play one game; 1.0 when the secret is found within ``max_turns`` answers, else 0.0."""
    spec = task.input
    game, client, temperature, messages = start(task, llm)
    for _ in range(spec["max_turns"]):
        reply = client.chat.completions.create(model=llm.model, messages=messages, temperature=temperature,
                                               max_tokens=spec["max_tokens"])
        answer = reply.choices[0].message.content or ""
        feedback = game.play(answer)
        if feedback is None:
            return 1.0
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": feedback}]
    return 0.0
