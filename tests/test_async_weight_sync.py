"""Weight syncs at the gateway: new calls wait, calls in flight finish under the old weights, nothing is lost.

Real HTTP on 127.0.0.1: the openai client in, the gateway, and the test policy
endpoint behind it, whose "weights" are a version number the sync changes.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from agl_core.builtin.memory_store import MemoryStore
from agl_core.config import GatewayConfig
from agl_core.data import Task
from agl_core.gateway import Gateway
from agl_core.gateway.weight_sync import CallGate
from agl_core.rollout.store import NewRollout
from agl_core.testing.endpoint import TestEndpoint

AGENTS = 32
CALLS_PER_AGENT = 6


class VersionedEndpoint(TestEndpoint):
    """The test endpoint with a weight version; it records which version answered each call, and any call
    whose version changed while it was being answered (a response of two policies)."""

    def __init__(self, delay_s: float):
        super().__init__(delay_s=delay_s)
        self.version = 0
        self.served: dict[str, int] = {}
        self.mixed: list[str] = []

    async def chat_completions(self, request):
        text = (await request.json())["messages"][-1]["content"]
        before = self.version
        response = await super().chat_completions(request)
        if self.version != before:
            self.mixed.append(text)
        self.served[text] = before
        return response


@pytest.fixture
def versioned():
    endpoint = VersionedEndpoint(delay_s=0.02)
    server = endpoint.serve()
    endpoint.url = server.url + "/v1"
    yield endpoint
    server.stop()


def test_weight_syncs_under_32_concurrent_agents_lose_no_call_and_record_the_serving_version(versioned):
    store = MemoryStore()
    ids = [f"r{i}" for i in range(AGENTS)]
    store.enqueue([NewRollout(rollout_id, Task(id=rollout_id, input={})) for rollout_id in ids])
    leases = {}
    for _ in ids:
        attempt = store.dequeue("w", lease_s=600)
        leases[attempt.rollout_id] = attempt.lease
    gateway = Gateway(store, GatewayConfig(max_retries=0), upstreams=[versioned.url])
    gateway.weight_version = 0
    server = gateway.serve()
    stop = threading.Event()

    def agent(rollout_id: str) -> list[str]:
        client = openai.OpenAI(base_url=Gateway.base_url(server.url, rollout_id, "1", leases[rollout_id]), api_key="x",
                               max_retries=0, timeout=30)
        texts = []
        for call in range(CALLS_PER_AGENT):
            text = f"{rollout_id}-{call}"
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}], max_tokens=4)
            texts.append(text)
        return texts

    def trainer() -> list[float]:
        """Syncs every 30 ms until the agents are done."""
        syncs = []
        while not stop.wait(0.03):
            with gateway.calls.paused(drain_timeout_s=10) as drained:
                assert drained.drained and gateway.calls.in_flight == 0
                versioned.version += 1  # the backend swaps the weights
                gateway.weight_version = versioned.version
                time.sleep(0.01)  # a swap takes time: calls arriving now must wait, not fail
            syncs.append(drained.wait_s)
        return syncs

    try:
        with ThreadPoolExecutor(AGENTS + 1) as pool:
            syncing = pool.submit(trainer)
            calls = [pool.submit(agent, rollout_id) for rollout_id in ids]
            texts = [text for future in calls for text in future.result()]  # raises if any call failed
            stop.set()
            syncing.result()
    finally:
        server.stop()
    assert len(texts) == AGENTS * CALLS_PER_AGENT
    assert versioned.mixed == []  # no call was answered across a swap
    recorded = {}
    for rollout_id in ids:
        for span in store.get_rollouts([rollout_id])[0].spans:
            assert "error" not in span.attributes
            recorded[span.attributes["request"]["messages"][-1]["content"]] = span.attributes["weight_version"]
    assert recorded.keys() == set(texts)
    assert recorded == {text: versioned.served[text] for text in texts}  # each span names the version that served it
    assert len(set(recorded.values())) >= 3  # the syncs happened while the agents called


def test_a_call_arriving_during_a_pause_waits_for_the_resume():
    gate = CallGate()

    async def call(events: list[str]):
        async with gate.admitted():
            events.append("forwarded")

    async def scenario():
        events: list[str] = []
        drained = await asyncio.to_thread(gate.pause, 1.0)
        assert drained.drained and drained.still_in_flight == 0
        task = asyncio.create_task(call(events))
        await asyncio.sleep(0.05)
        assert events == [] and gate.waiting == 1
        await asyncio.to_thread(gate.resume)
        await asyncio.wait_for(task, 5)
        assert events == ["forwarded"] and gate.in_flight == 0

    asyncio.run(scenario())


def test_a_pause_waits_for_calls_in_flight_and_reports_those_it_could_not_drain():
    gate = CallGate()
    release = threading.Event()
    entered = threading.Event()

    async def slow_call():
        async with gate.admitted():
            entered.set()
            await asyncio.to_thread(release.wait, 5)

    thread = threading.Thread(target=lambda: asyncio.run(slow_call()))
    thread.start()
    assert entered.wait(5)
    short = gate.pause(drain_timeout_s=0.05)
    assert not short.drained and short.still_in_flight == 1
    threading.Timer(0.1, release.set).start()
    drained = gate.pause(drain_timeout_s=5)
    assert drained.drained and drained.wait_s >= 0.05
    gate.resume()
    thread.join(5)
    assert gate.in_flight == 0


def test_a_paused_block_reopens_the_gate_even_when_the_swap_fails():
    gate = CallGate()
    with pytest.raises(RuntimeError):
        with gate.paused(1.0):
            raise RuntimeError("the swap failed")

    async def call():
        async with gate.admitted():
            return True

    assert asyncio.run(asyncio.wait_for(call(), 1))
