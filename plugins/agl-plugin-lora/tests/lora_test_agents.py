"""The agent of the end-to-end tests, named in recipes as ``lora_test_agents:say_five``."""

from __future__ import annotations

from openai import OpenAI


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


def two_roles(task, llm) -> float:
    """A planner (named by its role's base URL, whatever model it sends) then a solver (named by ``model``),
    then a critic (the base model, by role); 1.0 when the solver's first word is in REWARDED (about half the
    vocabulary: rewards within a group vary, so every step updates)."""
    planner = llm.for_role("planner")
    client = OpenAI(base_url=planner.base_url, api_key=llm.api_key, max_retries=0, timeout=30)
    plan = client.chat.completions.create(model="gpt-4o", max_tokens=2,
                                          messages=[{"role": "user", "content": task.input["text"]}])
    plain = OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0, timeout=30)
    answer = plain.chat.completions.create(model="solver", max_tokens=2, messages=[
        {"role": "user", "content": plan.choices[0].message.content or "guess"}]).choices[0].message.content or ""
    critic = llm.for_role("critic")
    OpenAI(base_url=critic.base_url, api_key=llm.api_key, max_retries=0, timeout=30).chat.completions.create(
        model=critic.model, max_tokens=1, messages=[{"role": "user", "content": answer or "a"}])
    words = answer.split()
    return float(bool(words) and words[0] in REWARDED)


REWARDED = {"1", "3", "5", "7", "9", "guess", "a", "number", "hello"}
