"""Two roles of one game that must cooperate: a hinter that sees the secret, a guesser that reads only the clue.

The hinter is asked for a clue to a secret number ("hint for 3") and writes
one word. The guesser sees only that word ("clue red") and answers a number.
A round pays half (``CLUE_SHARE``) for a clue that names the secret and half
for a guess that names it: 1.0 takes both roles. Each role is its own policy
of the run (its own LoRA adapter on the one base model): the agent makes a
client per role with ``llm.for_role(name)``, and the gateway routes each call
to that role's adapter and records the role on the call's span.

Why the clue's half is paid whatever the guess: from a model built from a
config (no pretraining) neither role's output depends on its input at first,
so with the win alone no clue is worth more than another and the pair never
agrees on a code. A bonus for the clue paid only on lost rounds is not
enough: a pair can settle on a code where one clue serves two secrets (the
hinter says "1" for both 1 and 4, the guesser reads "1" as 4), because the
hinter then earns more with the wrong clue the guesser reads than with the
right one it cannot read yet, and never tries the right one again. Paid on
every round, the clue that names the secret is the hinter's best whatever
the guesser does, and the guesser learns to read it.

Validation games are played greedily (temperature 0); training games use the
recipe's sampling (``llm.sampling``).
"""

from __future__ import annotations

import logging
import re

from openai import DefaultHttpxClient, OpenAI

from agl_core import agent, per_thread
from agl_core.data import Task

NUMBER = re.compile(r"-?\d+")
HINTER, GUESSER = "hinter", "guesser"
CLUE_SHARE = 0.5
"""The part of a round's reward paid for a clue that names the secret; the rest is paid for a guess that does."""

HTTP = per_thread(DefaultHttpxClient)
"""An HTTP client per worker thread, reused by its games (see examples/guess_number/agent.py)."""
for _name in ("httpx", "httpx2"):
    logging.getLogger(_name).setLevel(logging.WARNING)


def first_number(text: str) -> int | None:
    found = NUMBER.search(text)
    return int(found.group()) if found else None


def ask(llm, prompt: str, temperature: float) -> str:
    """One call of one role: ``llm`` is that role's handle (``llm.for_role``), so its calls reach its policy."""
    client = OpenAI(base_url=llm.base_url, api_key=llm.api_key, http_client=HTTP(), max_retries=0)
    reply = client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": prompt}],
                                           temperature=temperature, max_tokens=1)
    return (reply.choices[0].message.content or "").strip()


@agent("two_roles")
def two_roles(task: Task, llm) -> float:
    """Play one round: the hinter's clue, the guesser's number; 1.0 when both name the secret."""
    secret = task.input["secret"]
    temperature = 0.0 if task.split == "val" else llm.sampling.get("temperature", 1.0)
    clue = ask(llm.for_role(HINTER), f"hint for {secret}", temperature)
    guess = first_number(ask(llm.for_role(GUESSER), f"clue {clue}".strip(), temperature))
    return CLUE_SHARE * (first_number(clue) == secret) + (1 - CLUE_SHARE) * (guess == secret)
