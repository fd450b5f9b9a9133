"""Runners anywhere: ``agl runner`` processes lease rollouts from ``agl serve store`` and call ``agl serve gateway``.

Every service is a real separate process on 127.0.0.1 (the store service, the gateway, the test policy
endpoint, the runners); agents call the model through the real ``openai`` client. The trainer's side is
:func:`agl_core.rollout.runner.collect` over an ``HttpStore``, or a real ``Trainer`` with the ``remote_runners`` plugin.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agl_core.builtin.remote_runners import NAME as REMOTE_RUNNERS
from agl_core.data import Task
from agl_core.loop import Trainer
from agl_core.plugins import PluginError, PluginSet
from agl_core.rollout.runner import collect
from agl_core.rollout.store import NewRollout
from agl_core.rollout.store_client import HttpStore
from agl_core.testing import PolicyEndpoints
from agl_core.testing.endpoint import ByteTokenizer

TASKS = [Task(id=f"t{i}", input={"word": w}) for i, w in enumerate(["apple", "pear", "fig"])]
START_S = 60.0  # bound on a service's start-up (imports of torch on 2 busy cores)


def with_pythonpath(path) -> str:
    """``path`` ahead of this process's PYTHONPATH (a checkout's code first, as in this process)."""
    return os.pathsep.join(filter(None, [str(path), os.environ.get("PYTHONPATH")]))


AGENTS = '''
import os
import time

import openai
from agl_core import agent, emit_reward


@agent(name="echoer")
def echo(task, llm):
    """Asks the model to repeat a word, emits an intermediate reward, calls again; 1.0 when it was repeated."""
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    reply = client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": task.input["word"]}])
    emit_reward(0.5, stage="answered")
    time.sleep(float(os.environ.get("AGENT_SLEEP_S", "0")))
    client.completions.create(model=llm.model, prompt="and again")
    return float(task.input["word"] in reply.choices[0].message.content)
'''


def start(argv: list[str], log: Path, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """Start a service; return it and the first line it prints (its URL), read within START_S."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True,  # noqa: SIM115
                            env={**os.environ, **(env or {})})
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    if not selector.select(START_S):
        proc.kill()
        pytest.fail(f"{argv} printed nothing in {START_S} s: {log.read_text()}")
    line = proc.stdout.readline().strip()
    if not line:
        pytest.fail(f"{argv} exited ({proc.wait()}): {log.read_text()}")
    return proc, line


def agl(*args: str) -> list[str]:
    return [sys.executable, "-m", "agl_core.cli", *args]


def stopped(proc: subprocess.Popen, signum: int = signal.SIGTERM, timeout: float = 60.0) -> int:
    """Send ``signum`` and return the exit code (the process is killed if it outlives ``timeout``)."""
    if proc.poll() is None:
        proc.send_signal(signum)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"{proc.args} did not stop within {timeout} s of signal {signum}")
    return proc.returncode


class Plane:
    """The services of the rollout plane as processes: ``store``, ``gateway`` and ``endpoint`` URLs, and runners."""

    def __init__(self, tmp_path: Path):
        self.tmp_path = tmp_path
        (tmp_path / "remote_agents.py").write_text(AGENTS)
        self.procs: list[subprocess.Popen] = []
        self.store = self._start(agl("serve", "store", "--db", str(tmp_path / "store.sqlite")), "store")
        self.endpoint = self._start([sys.executable, "-m", "agl_core.testing.endpoint", "--port", "0"], "endpoint")
        self.gateway = self._start(agl("serve", "gateway", "--store", self.store,
                                       "--upstream", self.endpoint + "/v1"), "gateway")

    def _start(self, argv: list[str], name: str, env: dict[str, str] | None = None) -> str:
        proc, line = start(argv, self.tmp_path / f"{name}.log", env)
        self.procs.append(proc)
        return line

    def runner(self, name: str, *flags: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start ``agl runner`` of the echo agent; returns once it leases."""
        line = self._start(agl("runner", "--store", self.store, "--gateway", self.gateway,
                               "--agent", "remote_agents:echo", *flags), name,
                           {"PYTHONPATH": with_pythonpath(self.tmp_path), **(env or {})})
        assert line.startswith("agl runner: ")
        return self.procs[-1]

    def close(self) -> None:
        for proc in reversed(self.procs):
            stopped(proc)


@pytest.fixture
def plane(tmp_path):
    p = Plane(tmp_path)
    yield p
    p.close()


def test_runners_anywhere_run_a_steps_rollouts_through_the_services(plane):
    runners = [plane.runner(f"runner-{i}", "--workers", "2") for i in range(2)]
    store = HttpStore(plane.store)
    try:
        result = collect(store, TASKS, 2, metadata={"mode": "train", "step": 1}, id_prefix="train-1",
                         max_attempts=2)
    finally:
        store.close()
    rollouts = result.rollouts
    assert [(r.task_id, r.sample_index) for r in rollouts] == [(t.id, s) for t in TASKS for s in range(2)]
    tokenizer = ByteTokenizer()
    for rollout, task in zip(rollouts, [t for t in TASKS for _ in range(2)]):
        assert (rollout.status, rollout.final_reward, rollout.error, rollout.attempts) == ("succeeded", 1.0, None, 1)
        assert rollout.metadata == {"mode": "train", "step": 1, "task_id": task.id,
                                    "sample_index": rollout.sample_index}
        assert [(s.sequence_id, s.kind, s.attempt_id) for s in rollout.spans] == [
            (0, "llm_call", "1"), (1, "reward", "1"), (2, "llm_call", "1")]
        first, reward, second = rollout.spans
        assert first.response_token_ids == tokenizer.encode(f"echo: {task.input['word']}")
        assert first.attributes["upstream"] == plane.endpoint + "/v1"
        assert reward.reward == 0.5 and reward.attributes["agent_name"] == "echoer"
        assert second.prompt_token_ids == tokenizer.encode("and again")
    assert result.metrics["rollout/n_succeeded"] == 6 and result.metrics["rollout/n_retried"] == 0
    assert [stopped(r) for r in runners] == [0, 0]


def test_sigterm_stops_leasing_and_lets_the_running_attempts_end(plane):
    runner = plane.runner("runner", "--workers", "3", env={"AGENT_SLEEP_S": "2"})
    store = HttpStore(plane.store)
    try:
        ids = [f"r{i}" for i in range(3)]
        store.enqueue([NewRollout(i, task) for i, task in zip(ids, TASKS)])
        deadline = time.monotonic() + START_S
        while len(store.query(["running"])) < 3:  # each worker holds one, asleep in the agent
            assert time.monotonic() < deadline, "the runner did not lease the three rollouts"
            time.sleep(0.05)
        store.enqueue([NewRollout("late", TASKS[0])])
        assert stopped(runner) == 0
        assert [r.status for r in store.get_rollouts(ids)] == ["succeeded"] * 3
        late, = store.query(["queuing"])  # queued after the signal: left for another runner
        assert late.rollout_id == "late"
    finally:
        store.close()
    assert "stopping: no new rollouts; waiting up to 30 s for the" in (plane.tmp_path / "runner.log").read_text()



def test_a_trainer_collects_through_remote_runners(plane, make_recipe, monkeypatch):
    monkeypatch.syspath_prepend(str(plane.tmp_path))  # rollout.agent names the runners' agent; never imported here
    plane.runner("runner", "--workers", "3")
    recipe, plugins = make_recipe(
        ["rollout.agent=remote_agents:echo", "rollout.n=2", "data.train_batch_size=3", "data.max_response_length=5",
         "rollout.store=http", f"plugins.http_store.url={plane.store}",
         f"plugins.remote_runners.gateway_url={plane.gateway}", "plugins.slots.policy_endpoints=endpoints",
         f"plugins.slots.collect_rollouts={REMOTE_RUNNERS}",
         "trainer.val_before_train=true", "trainer.total_steps=1"],
        plugins=[("endpoints", PolicyEndpoints([plane.endpoint + "/v1"]))], flags=["instant", "remote_runners"])
    t = Trainer(recipe, plugins, train_tasks=TASKS, val_tasks=TASKS)
    metrics = t.fit()
    logged = [json.loads(line) for line in (t.ctx.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert logged[0]["val/n_rollouts"] == 3
    assert metrics["rollout/n_rollouts"] == 6 and metrics["rollout/n_succeeded"] == 6
    assert REMOTE_RUNNERS not in t.ctx.state  # its store client closed at the end of the run
    with contextlib.closing(sqlite3.connect(plane.tmp_path / "store.sqlite")) as conn:  # the run's record
        assert conn.execute("SELECT COUNT(*), SUM(status = 'succeeded') FROM rollouts").fetchone() == (9, 9)
        calls = [json.loads(row[0]) for row in conn.execute("SELECT span FROM spans")]
    calls = [s for s in calls if s["kind"] == "llm_call"]
    assert len(calls) == 18
    # the trainer set the gateway's policy: sampling.max_tokens = data.max_response_length, the initial weights
    assert all(len(s["response_token_ids"]) == 5 and s["attributes"]["weight_version"] == 0 for s in calls)


def test_remote_runners_is_inactive_unless_a_recipe_enables_it_and_then_wins_over_the_local_runner():
    plugins = PluginSet.load()
    assert plugins.plugins[REMOTE_RUNNERS].status == "available"
    assert plugins.resolve_slot("collect_rollouts")[0] == "local_runner"
    plugins = PluginSet.load(enable=[REMOTE_RUNNERS])
    assert plugins.plugins[REMOTE_RUNNERS].status == "active"
    assert plugins.resolve_slot("collect_rollouts")[0] == REMOTE_RUNNERS


def test_remote_runners_without_a_gateway_url_is_a_start_up_error(make_recipe):
    recipe, plugins = make_recipe(["rollout.agent=remote_agents:echo", "data.train_batch_size=3",
                                   "plugins.slots.policy_endpoints=endpoints",
                                   f"plugins.slots.collect_rollouts={REMOTE_RUNNERS}"],
                                  plugins=[("endpoints", PolicyEndpoints(["http://127.0.0.1:9/v1"]))],
                                  flags=["instant", "remote_runners"])
    with pytest.raises(PluginError, match="plugins.remote_runners.gateway_url is not set"):
        Trainer(recipe, plugins, train_tasks=TASKS, val_tasks=[]).fit()


@pytest.mark.parametrize("flags, named", [
    (["--workers", "0"], "agl: error: --workers must be positive, got 0"),
    (["--lease-s", "-1"], "agl: error: --lease-s must be positive, got -1"),
    (["--agent", "no_such_module:fn"], "agl: error: --agent no_such_module:fn: cannot import 'no_such_module'"),
])
def test_bad_runner_flags_are_one_line_naming_the_flag(flags, named):
    argv = {"--store": "http://127.0.0.1:9", "--gateway": "http://127.0.0.1:9", "--agent": "remote_agents:echo"}
    for flag, value in zip(flags[::2], flags[1::2]):
        argv[flag] = value
    done = subprocess.run(agl("runner", *[x for item in argv.items() for x in item]), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and named in done.stderr and "Traceback" not in done.stderr
