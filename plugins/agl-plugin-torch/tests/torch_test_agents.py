"""Agents for the end-to-end tests, named in recipes as ``torch_test_agents:<name>``."""

from __future__ import annotations

import threading

from openai import OpenAI

RELEASE = threading.Event()
"""Set by the tests when they end: a hanging agent waits on it (bounded) instead of sleeping forever."""


def say_five(task, llm) -> float:
    """Two turns of chat; 1.0 when the model's first answer holds the word "5"."""
    client = OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0, timeout=30)
    messages = [{"role": "user", "content": task.input["text"]}]
    reward = 0.0
    for _ in range(2):
        reply = client.chat.completions.create(model=llm.model, messages=messages, max_tokens=3)
        answer = reply.choices[0].message.content or ""
        reward = reward or float("5" in answer.split())
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "higher"}]
    return reward


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
    """Two turns of :func:`say_five`'s chat; the reward is higher the shorter the answers (it varies in a group)."""
    client = OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0, timeout=30)
    messages = [{"role": "user", "content": task.input["text"]}]
    tokens = 0
    for _ in range(2):
        reply = client.chat.completions.create(model=llm.model, messages=messages, max_tokens=3)
        tokens += reply.usage.completion_tokens
        messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                     {"role": "user", "content": "higher"}]
    return 1.0 - tokens / 6
