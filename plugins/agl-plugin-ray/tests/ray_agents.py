"""Agents the Ray tests run inside runner actors (imported there through the actors' runtime_env)."""

import os
import time

import openai
import ray

from agl_core import agent, emit_annotation


@agent(name="echo")
def echo(task, llm):
    """Asks the test endpoint to repeat a word (reward 1 when it does); notes which node and process ran it."""
    emit_annotation(node_id=ray.get_runtime_context().get_node_id(), pid=os.getpid())
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    reply = client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": task.input["word"]}])
    time.sleep(task.input["sleep_s"])  # long enough that every actor gets work, and that a kill lands mid-attempt
    return float(task.input["word"] in reply.choices[0].message.content)
