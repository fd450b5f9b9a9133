"""The Store protocol, checked on every store: memory (built-in), sqlite (agl-plugin-sqlite, a real file), and http
(HttpStore, the client of the store service, served here over real HTTP on 127.0.0.1 from a real file)."""

import threading
import time

import pytest
from agl_plugin_sqlite import SqliteStore

from agl_core.builtin.memory_store import MemoryStore
from agl_core.data import Span, Task
from agl_core.rollout.store import NewRollout, Store
from agl_core.rollout.store_client import HttpStore
from agl_core.rollout.store_server import RESERVE_SEQUENCE_IDS, StoreService


@pytest.fixture(params=["memory", "sqlite", "http"])
def store(request, tmp_path):
    if request.param != "http":
        s = MemoryStore() if request.param == "memory" else SqliteStore(tmp_path / "rollouts.sqlite")
        yield s
        s.close()
        return
    backing = SqliteStore(tmp_path / "rollouts.sqlite", reserve_sequence_ids=RESERVE_SEQUENCE_IDS)
    service = StoreService(backing)
    with service.server() as server:
        client = HttpStore(server.url, connect_timeout_s=10)
        client.backing = backing  # for the tests that look behind the wire
        yield client
        client.close()
    service.close()
    backing.close()


def new(rollout_id, max_attempts=1, **metadata):
    return NewRollout(rollout_id, Task(id=f"task-{rollout_id}", input={"q": rollout_id}), 0, max_attempts, metadata)


def call_span(rollout_id, attempt_id, sequence_id, n=3):
    return Span(rollout_id=rollout_id, attempt_id=attempt_id, sequence_id=sequence_id, kind="llm_call",
                prompt_token_ids=list(range(n)), response_token_ids=[7, 8], response_logprobs=[-0.1, -0.2],
                attributes={"request": {"messages": [{"role": "user", "content": "hi"}]}})


def test_both_satisfy_the_protocol(store):
    assert isinstance(store, Store)


def test_lifecycle_queuing_running_succeeded_with_spans(store):
    store.enqueue([new("a", agent_name="guesser"), new("b")])
    assert [r.status for r in store.query()] == ["queuing", "queuing"]
    attempt = store.dequeue("w1", lease_s=30)
    assert (attempt.rollout_id, attempt.attempt_id, attempt.task.input) == ("a", "1", {"q": "a"})
    assert attempt.metadata == {"agent_name": "guesser"}
    state = store.attempt_state("a", "1")
    assert state.current and state.rollout_status == "running" and state.metadata["agent_name"] == "guesser"
    assert not store.attempt_state("a", "2").current
    assert store.attempt_state("nope", "1") is None

    ids = [store.next_sequence_id("a") for _ in range(3)]
    assert ids == [0, 1, 2]
    leases = {("a", "1"): attempt.lease}
    store.add_spans([call_span("a", "1", 2), call_span("a", "1", 0)], leases=leases)
    store.add_spans([Span(rollout_id="a", attempt_id="1", sequence_id=1, kind="reward", reward=0.5)], leases=leases)
    assert store.finish("a", "1", "succeeded", final_reward=1.0, lease=attempt.lease)
    assert not store.finish("a", "1", "failed", lease=attempt.lease)  # already ended: no change

    (rollout,) = store.get_rollouts(["a"])
    assert rollout.status == "succeeded" and rollout.final_reward == 1.0 and rollout.task_id == "task-a"
    assert rollout.attempt_id == "1" and rollout.attempts == 1
    assert rollout.end_time >= rollout.start_time
    assert [(s.sequence_id, s.kind) for s in rollout.spans] == [(0, "llm_call"), (1, "reward"), (2, "llm_call")]
    assert rollout.spans[0] == call_span("a", "1", 0)
    assert {r.rollout_id for r in store.query(["queuing"])} == {"b"}


def test_admit_is_the_attempt_state_and_its_next_ids_in_one_call(store):
    store.enqueue([new("a", agent_name="guesser"), new("b")])
    attempt = store.dequeue("w1", lease_s=30)
    state, ids = store.admit("a", attempt.attempt_id, 2, lease=attempt.lease)
    assert state.current and state.rollout_status == "running" and state.metadata == {"agent_name": "guesser"}
    assert ids == [0, 1] and store.next_sequence_id("a") == 2
    assert store.admit("a", "2", 3) == (store.attempt_state("a", "2"), [])  # not the running attempt: no ids
    state, ids = store.admit("b", "1", 1)
    assert state.rollout_status == "queuing" and not state.current and ids == []
    assert store.admit("nope", "1", 1) == (None, [])
    assert store.admit("a", attempt.attempt_id, 1, lease=attempt.lease)[1] == [3]  # after the refused ones: nothing was used up


def test_duplicate_rollout_ids_are_refused(store):
    store.enqueue([new("a")])
    with pytest.raises(ValueError, match="already in the store"):
        store.enqueue([new("a")])


def test_dequeue_waits_for_work_then_gives_up(store):
    assert store.dequeue("w", lease_s=30, wait_s=0.1) is None

    threading.Timer(0.1, lambda: store.enqueue([new("late")])).start()
    attempt = store.dequeue("w", lease_s=30, wait_s=5)
    assert attempt is not None and attempt.rollout_id == "late"


def test_expired_lease_is_requeued_then_fails_after_max_attempts(store):
    store.enqueue([new("a", max_attempts=2), new("b")])
    first = store.dequeue("lost-worker", lease_s=0.05)
    assert first.rollout_id == "a"
    store.add_spans([call_span("a", "1", store.next_sequence_id("a"))], leases={("a", "1"): first.lease})
    time.sleep(0.1)
    # the lost attempt goes back to the front of the queue, ahead of "b"
    second = store.dequeue("w2", lease_s=0.05)
    assert (second.rollout_id, second.attempt_id) == ("a", "2")
    assert not store.heartbeat("a", "1", 30, lease=first.lease)
    assert not store.finish("a", "1", "succeeded", lease=first.lease)
    time.sleep(0.1)
    assert store.requeue_expired() == 1
    (rollout,) = store.get_rollouts(["a"])
    assert rollout.status == "failed" and rollout.attempts == 2
    assert "attempt 2 was lost" in rollout.error and "w2" in rollout.error
    assert rollout.spans == []  # the spans of attempt 1 are not mixed into the last attempt


def test_heartbeat_keeps_an_attempt_alive(store):
    store.enqueue([new("a", max_attempts=1)])
    attempt = store.dequeue("w", lease_s=0.5)
    time.sleep(0.05)
    assert store.heartbeat("a", attempt.attempt_id, 30, lease=attempt.lease)
    time.sleep(0.6)  # past the first lease: only the heartbeat keeps it
    assert store.requeue_expired() == 0 and store.attempt_state("a", attempt.attempt_id).current
    assert store.finish("a", attempt.attempt_id, "timed_out", error="too slow", lease=attempt.lease)
    assert store.get_rollouts(["a"])[0].status == "timed_out"


def test_wait_returns_when_all_finish_or_on_timeout(store):
    store.enqueue([new("a"), new("b")])
    a, b = store.dequeue("w", 30), store.dequeue("w", 30)
    assert store.wait(["a", "b"], timeout_s=0.05) == set()
    store.finish("a", a.attempt_id, "succeeded", lease=a.lease)
    threading.Timer(0.05, lambda: store.finish("b", b.attempt_id, "failed", error="boom", lease=b.lease)).start()
    assert store.wait(["a", "b"], timeout_s=5) == {"a", "b"}


def test_wait_sees_an_expired_lease_fail(store):
    store.enqueue([new("a", max_attempts=1)])
    store.dequeue("w", lease_s=0.05)
    assert store.wait(["a"], timeout_s=5) == {"a"}
    assert store.get_rollouts(["a"])[0].status == "failed"


def test_cancel_ends_unfinished_rollouts(store):
    store.enqueue([new("queued"), new("running"), new("done")])
    store.dequeue("w", 30)
    running = store.dequeue("w", 30)
    store.finish("running", "1", "succeeded", lease=running.lease)
    assert store.cancel(None, "abandoned") == 2
    assert {r.rollout_id: r.status for r in store.query()} == {"queued": "failed", "running": "succeeded",
                                                              "done": "failed"}
    assert store.dequeue("w", 30) is None


def test_release_forgets_consumed_rollouts(store):
    store.enqueue([new("a")])
    attempt = store.dequeue("w", 30)
    store.add_spans([call_span("a", attempt.attempt_id, store.next_sequence_id("a"))],
                    leases={("a", attempt.attempt_id): attempt.lease})
    store.finish("a", attempt.attempt_id, "succeeded", lease=attempt.lease)
    store.release(["a"])
    assert store.query() == []
    if isinstance(store, MemoryStore):
        assert store.get_rollouts(["a"]) == [] and store._entries == {}
    else:  # nothing in memory (the service's, behind http); the file keeps the record (keep_consumed)
        assert getattr(store, "backing", store)._sequence == {} and store.get_rollouts(["a"])[0].status == "succeeded"


def test_many_threads_dequeue_each_rollout_once(store):
    store.enqueue([new(f"r{i}") for i in range(60)])
    taken, lock = [], threading.Lock()

    def worker(name):
        while (attempt := store.dequeue(name, 30)) is not None:
            store.add_spans([call_span(attempt.rollout_id, "1", store.next_sequence_id(attempt.rollout_id))],
                            leases={(attempt.rollout_id, "1"): attempt.lease})
            store.finish(attempt.rollout_id, attempt.attempt_id, "succeeded", final_reward=1.0, lease=attempt.lease)
            with lock:
                taken.append(attempt.rollout_id)

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(taken) == sorted(f"r{i}" for i in range(60))
    rollouts = store.get_rollouts([f"r{i}" for i in range(60)])
    assert all(r.status == "succeeded" and len(r.spans) == 1 for r in rollouts)
