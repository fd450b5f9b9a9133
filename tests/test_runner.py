"""The local runner end to end: real agents with the openai client, the gateway, the test endpoint, a store."""

import asyncio
import contextlib
import json
import re
import sqlite3
import threading
import time
from pathlib import Path

import openai
import pytest

from agl_core import emit_reward
from agl_core.builtin.local_runner import NAME as LOCAL_RUNNER
from agl_core.builtin.memory_store import MemoryStore
from agl_core.config import GatewayConfig
from agl_core.data import Task
from agl_core.gateway import Gateway
from agl_core.loop import Trainer
from agl_core.plugins import PluginError
from agl_core.rollout.agents import LLM
from agl_core.rollout.runner import LocalRunner, cancel_abandoned, collect, wait_all
from agl_core.rollout.store import NewRollout
from agl_core.testing import PolicyEndpoints
from agl_core.testing.endpoint import ByteTokenizer, TestEndpoint

TASKS = [Task(id=f"t{i}", input={"word": w}) for i, w in enumerate(["apple", "pear", "fig"])]


def echo_agent(task, llm):
    """Asks the model to repeat a word; reward 1 when it does, with an intermediate reward."""
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    reply = client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": task.input["word"]}])
    emit_reward(0.5, stage="answered")
    client.completions.create(model=llm.model, prompt="and again")
    return float(task.input["word"] in reply.choices[0].message.content)


async def async_echo_agent(task, llm):
    async with openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0) as client:
        reply = await client.chat.completions.create(model=llm.model,
                                                     messages=[{"role": "user", "content": task.input["word"]}])
    emit_reward(0.75)  # and returns None: the last emitted reward is final
    assert reply.choices[0].message.content == f"echo: {task.input['word']}"


@pytest.fixture
def plane():
    """The test endpoint and a gateway over a memory store; ``plane.runner(agent, **options)`` starts a runner."""
    endpoint = TestEndpoint()
    endpoint_server = endpoint.serve()
    store = MemoryStore()
    gateway = Gateway(store, GatewayConfig(), {"temperature": 1.0}, upstreams=[endpoint_server.url + "/v1"])
    gateway_server = gateway.serve()
    runners = []

    class Plane:
        def runner(self, agent, **options):
            def llm_for(rollout_id, attempt_id, lease):
                return LLM(Gateway.base_url(gateway_server.url, rollout_id, attempt_id, lease), "policy", "key")

            runners.append(LocalRunner(store, agent, llm_for, **{"n_workers": 4, **options}).start())
            return runners[-1]

    p = Plane()
    p.store, p.endpoint = store, endpoint
    yield p
    for runner in runners:
        runner.stop()
    gateway_server.stop()
    endpoint_server.stop()


def test_a_sync_openai_agent_is_recorded_call_by_call(plane):
    result = plane.runner(echo_agent).run(TASKS, samples=2, metadata={"mode": "train"})
    rollouts = result.rollouts
    assert [(r.task_id, r.sample_index) for r in rollouts] == [(t.id, s) for t in TASKS for s in range(2)]
    assert len({r.rollout_id for r in rollouts}) == 6
    tokenizer = ByteTokenizer()
    for rollout, task in zip(rollouts, [t for t in TASKS for _ in range(2)]):
        assert rollout.status == "succeeded" and rollout.final_reward == 1.0 and rollout.error is None
        assert rollout.metadata == {"agent_name": "echo_agent", "mode": "train", "task_id": rollout.task_id,
                                    "sample_index": rollout.sample_index}
        assert [(s.sequence_id, s.kind) for s in rollout.spans] == [(0, "llm_call"), (1, "reward"), (2, "llm_call")]
        first, reward, second = rollout.spans
        assert first.response_token_ids == tokenizer.encode(f"echo: {task.input['word']}")
        assert first.attributes["agent_name"] == "echo_agent" and first.attributes["request"]["model"] == "policy"
        assert reward.reward == 0.5 and reward.attributes["stage"] == "answered"
        assert second.prompt_token_ids == tokenizer.encode("and again")
        assert all(s.attempt_id == rollout.attempt_id == "1" for s in rollout.spans)
    metrics = result.metrics
    assert metrics["rollout/n_rollouts"] == 6 and metrics["rollout/n_succeeded"] == 6
    assert metrics["rollout/n_failed"] == metrics["rollout/n_timed_out"] == metrics["rollout/n_retried"] == 0
    assert 0 < metrics["rollout/latency_s/p50"] <= metrics["rollout/latency_s/p99"] <= metrics["rollout/latency_s/max"]
    assert plane.store._entries == {}  # consumed rollouts are released


def test_an_async_agent_runs_on_its_workers_loop(plane):
    rollouts = plane.runner(async_echo_agent, n_workers=2).run(TASKS, samples=2).rollouts
    assert [r.status for r in rollouts] == ["succeeded"] * 6
    assert [r.final_reward for r in rollouts] == [0.75] * 6
    assert all([s.kind for s in r.spans] == ["llm_call", "reward"] for r in rollouts)


def test_failures_are_recorded_with_the_exception_text_and_do_not_stop_the_others(plane):
    def flaky(task, llm):
        if task.id == "t1":
            raise ValueError("the tool server said no")
        if task.id == "t2":
            return "a string"
        return 1.0

    result = plane.runner(flaky).run(TASKS)
    assert [r.status for r in result.rollouts] == ["succeeded", "failed", "failed"]
    assert "ValueError: the tool server said no" in result.rollouts[1].error
    assert "Traceback" in result.rollouts[1].error
    assert "must be a real number or None, got str" in result.rollouts[2].error
    assert result.metrics["rollout/n_failed"] == 2


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_an_agent_that_never_returns_times_out_and_the_step_goes_on(plane, kind):
    release = threading.Event()

    def stuck(task, llm):
        if task.id == "t0":
            release.wait(60)  # bounded: the test releases it at the end
        return 1.0

    async def stuck_async(task, llm):
        if task.id == "t0":
            await asyncio.sleep(60)
        return 1.0

    runner = plane.runner(stuck if kind == "sync" else stuck_async, n_workers=1, timeout_s=1.5)
    try:
        result = runner.run(TASKS)
        assert [r.status for r in result.rollouts] == ["timed_out", "succeeded", "succeeded"]
        assert "did not finish within rollout.timeout_s=1.5" in result.rollouts[0].error
        assert result.metrics["rollout/n_timed_out"] == 1
        # the stuck worker was replaced: the runner still has a worker for the next step
        assert [r.status for r in runner.run(TASKS[1:]).rollouts] == ["succeeded", "succeeded"]
    finally:
        release.set()


class LosingStore(MemoryStore):
    """A memory store whose first ``lose`` handed-out attempts are lost: their worker 'dies' on the spot."""

    def __init__(self, lose):
        super().__init__()
        self.lose = lose

    def dequeue(self, worker_id, lease_s, wait_s=0.0):
        attempt = super().dequeue(worker_id, lease_s, wait_s)
        if attempt is not None and self.lose > 0:
            self.lose -= 1
            return None  # nobody will heartbeat or finish it: its lease runs out
        return attempt


@pytest.mark.parametrize("lose, max_attempts, statuses, retried", [
    (3, 2, ["succeeded"] * 3, 3),
    (3, 1, ["failed"] * 3, 0),
    (6, 2, ["failed"] * 3, 3),
])
def test_lost_attempts_are_requeued_up_to_max_attempts(lose, max_attempts, statuses, retried):
    store = LosingStore(lose)

    def llm_for(rollout_id, attempt_id, lease):
        return LLM("http://unused/v1", "policy", "key")

    runner = LocalRunner(store, lambda task, llm: 1.0, llm_for, n_workers=2, lease_s=1.0,
                         max_attempts=max_attempts).start()
    try:
        result = runner.run(TASKS)
    finally:
        runner.stop()
    assert [r.status for r in result.rollouts] == statuses
    assert result.metrics["rollout/n_retried"] == retried
    for rollout in result.rollouts:
        if rollout.status == "failed":
            assert f"attempt {rollout.attempts} was lost" in rollout.error


def test_collect_ends_the_rollouts_of_a_lost_runner_even_when_no_runner_asks_for_work():
    store = MemoryStore()
    result = {}
    step = threading.Thread(target=lambda: result.update(step=collect(store, TASKS[:1], max_attempts=1, poll_s=0.1)))
    step.start()
    deadline = time.monotonic() + 10
    while not store.query(["queuing"]):
        assert time.monotonic() < deadline, "the step queued nothing"
        time.sleep(0.01)
    assert store.dequeue("a-runner-about-to-be-lost", lease_s=0.2) is not None  # nobody renews or finishes it
    step.join(10)
    assert not step.is_alive()
    rollout, = result["step"].rollouts
    assert rollout.status == "failed" and "attempt 1 was lost" in rollout.error


def test_a_step_whose_rollouts_nobody_runs_says_so_and_ends_when_a_runner_comes(caplog):
    """No runner leases from the store (remote runners not started): the wait warns each stretch without progress."""
    store = MemoryStore()
    store.enqueue([NewRollout("r", Task(id="t", input={}))])
    def late_runner():
        attempt = store.dequeue("late-runner", 30)
        store.finish("r", attempt.attempt_id, "succeeded", lease=attempt.lease)

    runner = threading.Timer(0.5, late_runner)
    runner.start()
    with caplog.at_level("WARNING", logger="agl_core.rollout.runner"):
        wait_all(store, ["r"], poll_s=0.05, stall_warning_s=0.2)
    runner.join()
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings and all("no rollout of this step has ended for" in w and "(1 of 1 still to end): are runners "
                            "leasing from the store?" in w for w in warnings)


# ------------------------------------------------------------------ through the plugin hooks



@pytest.fixture
def agent_module(tmp_path, monkeypatch):
    (tmp_path / "word_agents.py").write_text(
        "import openai\n"
        "from agl_core import agent\n\n"
        "@agent(name='repeater')\n"
        "def repeat(task, llm):\n"
        "    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)\n"
        "    reply = client.chat.completions.create(model=llm.model, messages=[{'role': 'user', 'content': 'x'}],\n"
        "                                           **llm.sampling)\n"
        "    return float(reply.choices[0].finish_reason == 'length')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "word_agents", raising=False)
    return "word_agents:repeat"


@pytest.fixture
def endpoint_url():
    endpoint = TestEndpoint()
    server = endpoint.serve()
    yield server.url + "/v1"
    server.stop()


def trainer(make_recipe, agent, urls, overrides=(), flags=()):
    recipe, plugins = make_recipe(
        [f"rollout.agent={agent}", "rollout.n=2", "rollout.n_workers=2", "data.train_batch_size=3",
         "data.max_response_length=5", f"plugins.slots.collect_rollouts={LOCAL_RUNNER}",
         "plugins.slots.policy_endpoints=endpoints", *overrides],
        plugins=[("endpoints", PolicyEndpoints(urls))], flags=["instant", *flags])
    return Trainer(recipe, plugins, train_tasks=TASKS, val_tasks=TASKS)


def test_collect_rollouts_through_the_trainer_with_a_sqlite_store(make_recipe, agent_module, endpoint_url):
    t = trainer(make_recipe, agent_module, [endpoint_url],
                ["rollout.store=sqlite", "trainer.val_before_train=true", "trainer.total_steps=1"], ["sqlite"])
    assert t.plan.slots["collect_rollouts"][0] == LOCAL_RUNNER
    assert t.plan.slots["policy_endpoints"][0] == "endpoints"
    metrics = t.fit()
    logged = [json.loads(line) for line in (t.ctx.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert logged[0]["val/n_rollouts"] == 3 and logged[0]["val/reward/mean"] == 1.0
    # sampling.max_tokens defaults to data.max_response_length: "echo: x" is cut to 5 tokens
    assert metrics["rollout/n_rollouts"] == 6 and metrics["rollout/n_succeeded"] == 6
    assert metrics["training/skipped_step"] == 1.0  # the instant backend trains on triplets, not spans
    assert LOCAL_RUNNER not in t.ctx.state  # closed at the end of the run

    with contextlib.closing(sqlite3.connect(Path(t.ctx.run_dir) / "rollouts.sqlite")) as conn:
        assert conn.execute("SELECT COUNT(*), SUM(status = 'succeeded') FROM rollouts").fetchone() == (9, 9)
        spans = [json.loads(row[0]) for row in conn.execute("SELECT span FROM spans")]
    assert len(spans) == 9 and all(len(s["response_token_ids"]) == 5 for s in spans)
    assert {s["attributes"]["agent_name"] for s in spans} == {"repeater"}
    # validation before step 1 and the rollouts of step 1 both see the initial weights (no update yet)
    assert {s["attributes"]["weight_version"] for s in spans} == {0}


def test_a_recipe_without_an_agent_is_a_start_up_error(make_recipe, endpoint_url):
    recipe, plugins = make_recipe([f"plugins.slots.collect_rollouts={LOCAL_RUNNER}", "data.train_batch_size=3",
                                   "trainer.val_before_train=false"], flags=["instant"])
    t = Trainer(recipe, plugins, train_tasks=TASKS, val_tasks=[])
    with pytest.raises(PluginError, match="rollout.agent, which is not set"):
        t.fit()


def test_no_policy_server_is_a_clear_error(make_recipe, agent_module):
    t = trainer(make_recipe, agent_module, [], ["trainer.val_before_train=false", "trainer.total_steps=1"])
    with pytest.raises(PluginError, match="returned no server URL"):
        t.fit()


def test_the_docs_example_runs(capsys):
    text = (Path(__file__).parents[1] / "docs" / "rollout.md").read_text()
    example = re.findall(r"```python\n(.*?)```", text, re.S)[1]
    exec(compile(example, "docs/rollout.md", "exec"), {"__name__": "docs_example"})
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "4.0 succeeded" and all(" succeeded 1.0 " in line for line in out[:-1])


def test_cancel_abandoned_ends_only_the_rollouts_of_its_own_run():
    """A store service may be shared by several trainers: a starting one ends its own run's leftovers only."""
    store = MemoryStore()
    task = Task(id="t", input={})
    store.enqueue([NewRollout("mine", task, metadata={"run_id": "A"}),
                   NewRollout("theirs", task, metadata={"run_id": "B"}), NewRollout("untagged", task),
                   NewRollout("mine-running", task, metadata={"run_id": "A"})])
    store.dequeue("w", lease_s=60)  # "mine" is running now
    assert cancel_abandoned(store, "A") == 3
    statuses = {r.rollout_id: r.status for r in store.query()}
    assert statuses == {"mine": "failed", "theirs": "queuing", "untagged": "failed", "mine-running": "failed"}
    assert cancel_abandoned(store, "A") == 0
    store.close()


def test_a_worker_loop_closes_over_what_an_agent_left_running():
    """What an async agent leaves behind (a background task, an async generator dropped mid-way) ends with its
    worker's loop, as under asyncio.run, instead of being destroyed pending."""
    from agl_core.rollout.runner import close_loop

    ended = []

    async def stream():
        try:
            while True:
                yield 1
                await asyncio.sleep(0)
        finally:
            ended.append("generator")

    async def forever():
        try:
            await asyncio.sleep(3600)
        finally:
            ended.append("task")

    async def agent():
        left = asyncio.get_running_loop().create_task(forever())
        events = stream()
        await events.__anext__()  # read once, never closed
        await asyncio.sleep(0)
        return left, events

    loop = asyncio.new_event_loop()
    left, events = loop.run_until_complete(agent())
    close_loop(loop)
    assert loop.is_closed() and left.cancelled()
    assert sorted(ended) == ["generator", "task"]
