"""Faults of the rollout plane as services: a runner killed with SIGKILL mid-rollout, wrong or missing tokens,
and a runner started against a store service that does not answer.

A killed runner's rollouts are requeued when their leases run out and finished by another runner: none lost,
none twice, each with the spans of its final attempt only. A call without the gateway's token is answered 401
and writes nothing. A runner that cannot reach its store retries with backoff, logging each retry, and exits
after ``--connect-timeout-s`` with one ``agl: error:`` line naming the URL.

Real parts only: ``agl serve store``, ``agl serve gateway`` and ``agl runner`` as separate processes, the test
policy endpoint on 127.0.0.1, agents calling the model through the real ``openai`` client.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sqlite3
import threading
from pathlib import Path

import httpx
import openai
import pytest

from agl_core.data import Task
from agl_core.gateway import Gateway
from agl_core.gateway.client import set_policy
from agl_core.rollout.runner import collect
from agl_core.rollout.store import NewRollout
from agl_core.rollout.store_client import HttpStore

TOKEN = "gateway-secret"
ADMIN = "gateway-admin-secret"
"""The gateway's admin token: the trainer's, never the agents'."""
LEASE_S = 2
START_S = 60.0  # bound on a process's start-up (it imports torch, on 2 busy cores)

def with_pythonpath(path) -> str:
    """``path`` ahead of this process's PYTHONPATH (a checkout's code first, as in this process)."""
    return os.pathsep.join(filter(None, [str(path), os.environ.get("PYTHONPATH")]))


AGENTS = '''
import os
import time

import openai
from agl_core import emit_reward


def echo(task, llm):
    """Calls the model, emits a reward, sleeps $AGENT_SLEEP_S (a runner to be killed hangs here), calls again."""
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    reply = client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": task.id}])
    emit_reward(0.5)
    time.sleep(float(os.environ.get("AGENT_SLEEP_S", "0")))
    client.completions.create(model=llm.model, prompt="again")
    return float(reply.choices[0].message.content == f"echo: {task.id}")
'''


def printed_line(agl, log: Path, prefix: str) -> str:
    """The first line of ``log`` that starts with ``prefix`` (a service prints its URL so), within START_S."""

    def line():
        text = log.read_text() if log.exists() else ""
        return next((x for x in text.splitlines() if x.startswith(prefix)), None)

    return agl.wait_until(line, START_S, f"a line starting {prefix!r} in {log}")


class Plane:
    """``agl serve store`` and ``agl serve gateway`` (token :data:`TOKEN`) as processes; ``runner()`` adds runners."""

    def __init__(self, agl, tmp_path: Path, endpoint_url: str):
        self.agl, self.tmp_path = agl, tmp_path
        (tmp_path / "fault_agents.py").write_text(AGENTS)
        self.procs = []
        self.store = self._service("store", "serve", "store", "--db", tmp_path / "store.sqlite")
        self.gateway = self._service("gateway", "serve", "gateway", "--store", self.store, "--token", TOKEN,
                                     "--upstream", endpoint_url, env={"AGL_GATEWAY_ADMIN_TOKEN": ADMIN})

    def _service(self, name: str, *args, env=None, prefix: str = "http://") -> str:
        log = self.tmp_path / f"{name}.log"
        self.procs.append(self.agl.spawn(*args, env=env, log=log))
        return printed_line(self.agl, log, prefix)

    def runner(self, name: str, sleep_s: float = 0.0):
        self._service(name, "runner", "--store", self.store, "--gateway", self.gateway, "--gateway-token", TOKEN,
                      "--agent", "fault_agents:echo", "--workers", "4", "--lease-s", LEASE_S,
                      env={"PYTHONPATH": with_pythonpath(self.tmp_path), "AGENT_SLEEP_S": str(sleep_s)},
                      prefix="agl runner: ")
        return self.procs[-1]

    def close(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(60)
            except Exception:  # noqa: BLE001 - never leave a process behind
                proc.kill()


@pytest.fixture
def plane(agl, tmp_path, endpoint):
    p = Plane(agl, tmp_path, endpoint.url)
    yield p
    p.close()


def test_a_runner_killed_mid_rollout_has_its_rollouts_finished_by_another_once(plane, agl):
    tasks = [Task(id=f"task-{i}", input={}) for i in range(4)]
    killed = plane.runner("runner-killed", sleep_s=120)  # bounded: it is killed long before
    store = HttpStore(plane.store)
    result = {}
    step = threading.Thread(target=lambda: result.update(step=collect(store, tasks, max_attempts=2, poll_s=0.5)))
    step.start()
    try:
        def first_calls_recorded():  # every rollout is mid-way: its first call and reward are in the file
            with contextlib.closing(sqlite3.connect(plane.tmp_path / "store.sqlite")) as conn:
                return conn.execute("SELECT COUNT(*) FROM spans").fetchone()[0] >= 2 * len(tasks)

        agl.wait_until(first_calls_recorded, START_S, "the first runner's agents to be mid-rollout")
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        plane.runner("runner-2")
        step.join(120)
        assert not step.is_alive(), "the step did not end within 120 s of the second runner's start"
    finally:
        store.close()
    rollouts = result["step"].rollouts
    assert [r.task_id for r in rollouts] == [t.id for t in tasks] and len({r.rollout_id for r in rollouts}) == 4
    for rollout in rollouts:
        assert (rollout.status, rollout.final_reward, rollout.attempts) == ("succeeded", 1.0, 2)
        assert [(s.sequence_id > 1, s.kind, s.attempt_id) for s in rollout.spans] == [
            (True, "llm_call", "2"), (True, "reward", "2"), (True, "llm_call", "2")]
    assert result["step"].metrics["rollout/n_retried"] == 4
    # the file: each rollout once, ended once
    with contextlib.closing(sqlite3.connect(plane.tmp_path / "store.sqlite")) as conn:
        assert conn.execute("SELECT COUNT(*), SUM(status = 'succeeded') FROM rollouts").fetchone() == (4, 4)


@pytest.mark.parametrize("token", [None, "wrong", TOKEN])
def test_a_missing_or_wrong_token_is_401_and_writes_nothing(plane, endpoint, token):
    """The admin route takes the admin token only: the agents' own token (TOKEN) is refused like a wrong one."""
    with pytest.raises(ValueError, match=r"answered PUT /v1/admin/policy with 401: missing or wrong bearer token"):
        set_policy(plane.gateway, urls=["http://127.0.0.1:9/v1"], weight_version=5, token=token)
    health = httpx.get(f"{plane.gateway}/healthz", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert health["upstreams"] == [endpoint.url]  # unchanged

    store = HttpStore(plane.store)
    try:
        store.enqueue([NewRollout("r", Task(id="t", input={}))])
        attempt = store.dequeue("test", lease_s=60)
        base_url = Gateway.base_url(plane.gateway, "r", attempt.attempt_id, attempt.lease)
        body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
        if token == TOKEN:  # the agents' token: refused by the admin route above, taken by the agents' routes
            pass
        elif token is None:  # the openai client always sends a key
            refused = httpx.post(f"{base_url}/chat/completions", json=body)
            assert refused.status_code == 401 and "missing or wrong bearer token" in refused.text
        else:
            with pytest.raises(openai.AuthenticationError, match="missing or wrong bearer token"):
                openai.OpenAI(base_url=base_url, api_key=token, max_retries=0).chat.completions.create(**body)
        answered = openai.OpenAI(base_url=base_url, api_key=TOKEN, max_retries=0)
        answered.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        store.finish("r", attempt.attempt_id, "succeeded", 1.0, lease=attempt.lease)

        def spans():
            return store.get_rollouts(["r"])[0].spans

        plane.agl.wait_until(spans, 30, "the answered call's span")
        # the refused call took no sequence id and left no span: the one span is the answered call's
        assert [(s.sequence_id, s.kind) for s in spans()] == [(0, "llm_call")]
    finally:
        store.close()


def test_a_runner_with_a_wrong_gateway_token_exits_naming_the_gateway(plane, agl):
    done = agl.run("runner", "--store", plane.store, "--gateway", plane.gateway, "--gateway-token", "wrong",
                   "--agent", "fault_agents:echo", "--connect-timeout-s", 5,
                   env={"PYTHONPATH": with_pythonpath(plane.tmp_path)},
                   timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"agl: error: the gateway at {plane.gateway} refuses the token given" in done.stderr


def test_a_runner_against_a_store_that_does_not_answer_retries_then_exits_naming_it(agl, tmp_path):
    (tmp_path / "fault_agents.py").write_text(AGENTS)
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    done = agl.run("runner", "--store", url, "--gateway", "http://127.0.0.1:9", "--agent", "fault_agents:echo",
                   "--connect-timeout-s", 2, env={"PYTHONPATH": with_pythonpath(tmp_path)}, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("agl: error:")]
    assert len(errors) == 1 and f"the store service at {url} does not answer" in errors[0]
    assert "gave up after 2 s" in errors[0]
    retries = [line for line in done.stderr.splitlines() if f"the store service at {url} does not answer" in line
               and "retrying in" in line]
    assert len(retries) >= 3  # backoff from 0.25 s: 0.25, 0.5, 1 s fit in 2 s
