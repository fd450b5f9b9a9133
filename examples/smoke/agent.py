"""The smoke agent: one model call, rewarded by the share of its answer that is the target word.

The reward is dense (any share in [0, 1], not a win or a loss), so a randomly
initialised model's samples already differ in reward, every group has an
advantage and every step's update moves the weights: what a smoke run of a
backend needs to show that it trains (``scripts/check_run.py``). The same
module holds the broken agents the checker's tests run (:func:`always_fails`,
:func:`fails_after_first_step`).
"""

from __future__ import annotations

import logging
import os

from openai import DefaultHttpxClient, OpenAI

from agl_core import agent, per_thread
from agl_core.data import Task

TARGET = "yes"
"""The word the policy is rewarded for saying."""

HTTP = per_thread(DefaultHttpxClient)
for _name in ("httpx", "httpx2"):
    logging.getLogger(_name).setLevel(logging.WARNING)


def reward(answer: str, target: str = TARGET) -> float:
    """The share of the answer's letters (spaces aside) that spell ``target`` (0 for an empty answer).

    Counted on letters, not words: a serving engine may detokenize a word
    tokenizer's answer with or without spaces between the words.
    """
    letters = "".join(answer.split())
    return letters.count(target) * len(target) / len(letters) if letters else 0.0


def ask(task: Task, llm) -> str:
    client = OpenAI(base_url=llm.base_url, api_key=llm.api_key, http_client=HTTP(), max_retries=0)
    temperature = 0.0 if task.split == "val" else llm.sampling.get("temperature", 1.0)
    reply = client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": task.input["prompt"]}],
                                           temperature=temperature, max_tokens=task.input["max_tokens"])
    return reply.choices[0].message.content or ""


@agent("smoke")
def smoke(task: Task, llm) -> float:
    """Ask once; the reward is :func:`reward` of the answer."""
    return reward(ask(task, llm))


@agent("always_fails")
def always_fails(task: Task, llm) -> float:
    """Calls the model, then fails: a run of it trains nothing, and must not pass a smoke check."""
    ask(task, llm)
    raise RuntimeError("the smoke test's always-failing agent")


_played = 0


@agent("fails_after_first_step")
def fails_after_first_step(task: Task, llm) -> float:
    """:func:`smoke` for the first ``$AGL_SMOKE_GOOD_ROLLOUTS`` training rollouts of the process, failing after.

    With that many rollouts a step, the second step's rollouts all fail and the step is skipped.
    """
    global _played
    if task.split != "val":
        _played += 1
        if _played > int(os.environ.get("AGL_SMOKE_GOOD_ROLLOUTS", "16")):
            raise RuntimeError("the smoke test's agent fails from the second step on")
    return smoke(task, llm)
