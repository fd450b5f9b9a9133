"""Agents for the end-to-end tests, named in recipes as ``torch_test_agents:<name>``."""

from __future__ import annotations

import threading

from openai import OpenAI

RELEASE = threading.Event()
"""Set by the tests when they end: a hanging agent waits on it (bounded) instead of sleeping forever."""


def play_two_turns(task, llm) -> list:
    """Two turns of chat (the task's text, then "higher"); the model's two replies."""
    client = OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0, timeout=30)
    messages = [{"role": "user", "content": task.input["text"]}]
    replies = []
    for _ in range(2):
        replies.append(client.chat.completions.create(model=llm.model, messages=messages, max_tokens=3))
        messages += [{"role": "assistant", "content": replies[-1].choices[0].message.content or ""},
                     {"role": "user", "content": "higher"}]
    return replies


def say_five(task, llm) -> float:
    """:func:`play_two_turns`; 1.0 when an answer holds the word "5"."""
    answers = [reply.choices[0].message.content or "" for reply in play_two_turns(task, llm)]
    return float(any("5" in answer.split() for answer in answers))


def faulty(task, llm):
    """Misbehaves as ``task.input["fault"]`` says: raise, hang, return garbage; otherwise plays :func:`say_five`."""
    fault = task.input.get("fault")
    if fault == "raise":
        raise RuntimeError("the agent crashed")
    if fault == "hang":
        RELEASE.wait(4)  # far past the test's rollout timeout, yet bounded
        return 0.0
    if fault == "garbage":
        return "not a reward"
    return say_five(task, llm)


def short_answers(task, llm) -> float:
    """:func:`play_two_turns`; the shorter the answers, the higher the reward (it varies within a group)."""
    return 1.0 - sum(reply.usage.completion_tokens for reply in play_two_turns(task, llm)) / 6
