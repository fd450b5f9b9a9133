"""Faults of agents: one that raises, one that hangs past ``rollout.timeout_s``, ones that return NaN, infinity
or a string. Each is a rollout that ends failed or timed out with the reason recorded, while the step's other
rollouts succeed.

Real parts only: the local runner over a SQLite store (a real file), the gateway and the test policy endpoint
on 127.0.0.1, and agents that call the model through the real ``openai`` client.
"""

from __future__ import annotations

import threading

import numpy as np
import openai
import pytest
from agl_plugin_sqlite import SqliteStore

from agl_core.config import GatewayConfig
from agl_core.data import Task
from agl_core.gateway import Gateway
from agl_core.rollout.agents import LLM
from agl_core.rollout.runner import LocalRunner
from agl_core.testing.endpoint import TestEndpoint

TIMEOUT_S = 2.0
RELEASE = threading.Event()  # set at the end of the test: the hanging agent's thread then ends too


def ask(llm: LLM, word: str) -> str:
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    reply = client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": word}])
    return reply.choices[0].message.content


def agent(task: Task, llm: LLM):
    """Calls the model once, then behaves as the task says."""
    answer = ask(llm, task.id)
    behaviour = task.input["behaviour"]
    if behaviour == "raise":
        raise RuntimeError("the tool server said no")
    if behaviour == "hang":
        RELEASE.wait(60)  # bounded, and released by the test long before
        return 1.0
    return {"ok": float(answer == f"echo: {task.id}"), "nan": float("nan"), "inf": float("inf"),
            "string": "seven", "numpy": np.float32(0.5)}[behaviour]


# behaviour -> (status, what the recorded error contains; None: no error)
EXPECTED = {
    "ok": ("succeeded", None),
    "numpy": ("succeeded", None),
    "raise": ("failed", "RuntimeError: the tool server said no"),
    "hang": ("timed_out", f"the agent did not finish within rollout.timeout_s={TIMEOUT_S:g}"),
    "nan": ("failed", "the reward returned by agent 'agent' must be finite (and within float's range), got nan"),
    "inf": ("failed", "the reward returned by agent 'agent' must be finite (and within float's range), got inf"),
    "string": ("failed", "the reward returned by agent 'agent' must be a real number or None, got str 'seven'"),
}


@pytest.fixture
def runner(tmp_path):
    """A local runner of :func:`agent` on a SQLite store, through the gateway to the test endpoint."""
    endpoint_server = TestEndpoint().serve()
    store = SqliteStore(tmp_path / "rollouts.sqlite")
    gateway_server = Gateway(store, GatewayConfig(), {}, upstreams=[endpoint_server.url + "/v1"]).serve()

    def llm_for(rollout_id, attempt_id, lease):
        return LLM(Gateway.base_url(gateway_server.url, rollout_id, attempt_id, lease), "policy", "key")

    RELEASE.clear()
    runner = LocalRunner(store, agent, llm_for, n_workers=len(EXPECTED), timeout_s=TIMEOUT_S).start()
    yield runner
    RELEASE.set()
    runner.stop()
    gateway_server.stop()
    endpoint_server.stop()
    store.close()


def test_bad_agents_fail_alone_with_their_reason_and_the_step_goes_on(runner):
    tasks = [Task(id=f"task-{behaviour}", input={"behaviour": behaviour}) for behaviour in EXPECTED]
    result = runner.run(tasks)
    by_behaviour = {task.input["behaviour"]: rollout for task, rollout in zip(tasks, result.rollouts, strict=True)}
    for behaviour, (status, error) in EXPECTED.items():
        rollout = by_behaviour[behaviour]
        assert rollout.status == status, (behaviour, rollout.error)
        if error is None:
            assert rollout.error is None
        else:
            assert error in rollout.error, (behaviour, rollout.error)
    assert by_behaviour["ok"].final_reward == 1.0 and by_behaviour["numpy"].final_reward == 0.5
    for rollout in result.rollouts:  # every agent's model call was recorded, also when it went wrong after
        assert [s.kind for s in rollout.spans] == ["llm_call"], rollout.task_id
    assert "Traceback" in by_behaviour["raise"].error  # the agent's own stack, for its author
    metrics = result.metrics
    assert (metrics["rollout/n_succeeded"], metrics["rollout/n_failed"], metrics["rollout/n_timed_out"]) == (2, 4, 1)

    # The hung worker was replaced: the next step runs on a full set of workers.
    again = runner.run([Task(id="task-ok", input={"behaviour": "ok"}) for _ in range(len(EXPECTED))])
    assert [r.status for r in again.rollouts] == ["succeeded"] * len(EXPECTED)
