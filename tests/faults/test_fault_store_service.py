"""Faults of the store service: the service killed (kill -9) and restarted under its clients, a client killed
mid-lease, a service that does not answer. The service is a real ``agl serve store`` process on a real file."""

import collections
import contextlib
import socket
import sqlite3
import subprocess
import sys
import textwrap
import threading

import pytest

from agl_core.data import Span, Task
from agl_core.rollout.store import NewRollout
from agl_core.rollout.store_client import HttpStore

ROLLOUTS, CALLS, SPANS_PER_CALL = 30, 6, 4


def serve_store(agl, db, log, port=0):
    """``agl serve store --db DB --port PORT`` as a process, and the URL it printed once it accepts connections."""
    proc = agl.spawn("serve", "store", "--db", db, "--port", port, log=log)

    def url():
        assert proc.poll() is None, f"agl serve store exited ({proc.returncode}): {log.read_text()}"
        return next((line for line in log.read_text().splitlines() if line.startswith("http://")), None)

    return proc, agl.wait_until(url, timeout=120, what="agl serve store to print its URL")


def kill(proc):
    proc.kill()
    proc.wait(timeout=30)


def span(rollout_id, attempt_id, sequence_id):
    return Span(rollout_id=rollout_id, attempt_id=attempt_id, sequence_id=sequence_id, kind="llm_call",
                prompt_token_ids=list(range(30)), response_token_ids=[sequence_id], response_logprobs=[-0.5])


def work(store, ids, added, finished, errors):
    """Lease, record and finish every rollout of ``ids``, as a runner and its gateway would."""
    try:
        while (done := store.wait(ids, timeout_s=0)) != set(ids):
            attempt = store.dequeue("worker", lease_s=20, wait_s=1)
            if attempt is None:
                continue
            key = (attempt.rollout_id, attempt.attempt_id)
            for _ in range(CALLS):
                spans = [span(*key, store.next_sequence_id(attempt.rollout_id)) for _ in range(SPANS_PER_CALL)]
                store.add_spans(spans, leases={key: attempt.lease})
                added[key] += [s.sequence_id for s in spans]
            if store.finish(*key, "succeeded", final_reward=1.0, lease=attempt.lease):
                finished.append(key)
        assert done == set(ids)
    except BaseException as exc:  # noqa: BLE001 - re-raised by the test
        errors.append(exc)


def test_kill_9_and_restart_of_the_service_loses_and_doubles_no_span_and_the_work_completes(agl, tmp_path):
    db = tmp_path / "rollouts.sqlite"
    proc, url = serve_store(agl, db, tmp_path / "serve-0.log")
    port = int(url.rsplit(":", 1)[1])
    store = HttpStore(url, connect_timeout_s=120, batch_size=8)
    ids = [f"r{i}" for i in range(ROLLOUTS)]
    store.enqueue([NewRollout(rid, Task(id=rid, input={}), max_attempts=10) for rid in ids])
    added, finished, errors = collections.defaultdict(list), [], []
    worker = threading.Thread(target=work, args=(store, ids, added, finished, errors), daemon=True)
    worker.start()
    try:
        for restart, after in enumerate((5, 15), start=1):
            agl.wait_until(lambda: len(finished) >= after or not worker.is_alive(), timeout=120,
                           what=f"{after} rollouts finished")
            kill(proc)  # kill -9, while the worker leases, uploads and finishes
            proc, again = serve_store(agl, db, tmp_path / f"serve-{restart}.log", port)
            assert again == url
        worker.join(timeout=300)
        assert not worker.is_alive(), "the worker did not finish within 300 s"
        assert errors == []
        store.flush()

        rollouts = store.get_rollouts(ids)
        assert [r.status for r in rollouts] == ["succeeded"] * ROLLOUTS
        for rollout in rollouts:  # the last attempt's spans: every one added, once, in order
            assert [s.sequence_id for s in rollout.spans] == added[(rollout.rollout_id, rollout.attempt_id)]
        with contextlib.closing(sqlite3.connect(db)) as conn:  # and nothing of any attempt lost or doubled
            in_file = conn.execute("SELECT rollout_id, attempt_id, sequence_id FROM spans").fetchall()
        assert sorted(in_file) == sorted((*key, i) for key, seq in added.items() for i in seq)
        store.close()
    finally:
        kill(proc)


DOOMED_CLIENT = """
import sys
from agl_core.rollout.store_client import HttpStore

attempt = HttpStore(sys.argv[1]).dequeue("doomed", lease_s=1.0, wait_s=30)
print(attempt.rollout_id, attempt.attempt_id, flush=True)
sys.stdin.read()  # holds the lease until killed
"""


def test_a_client_killed_mid_lease_loses_the_attempt_and_another_takes_the_rollout(agl, tmp_path):
    proc, url = serve_store(agl, tmp_path / "rollouts.sqlite", tmp_path / "serve.log")
    store = HttpStore(url, connect_timeout_s=30)
    doomed = subprocess.Popen([sys.executable, "-c", textwrap.dedent(DOOMED_CLIENT), url], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        store.enqueue([NewRollout("a", Task(id="t", input={}), max_attempts=2)])
        out = doomed.stdout.readline()  # bounded: the child gives up on its own within its timeouts
        assert out.split() == ["a", "1"], doomed.stderr.read() if doomed.poll() is not None else out
        kill(doomed)
        attempt = store.dequeue("survivor", lease_s=30, wait_s=60)  # once the lease ran out
        assert (attempt.rollout_id, attempt.attempt_id) == ("a", "2")
        (rollout,) = store.get_rollouts(["a"])
        assert "attempt 1 was lost: worker doomed stopped renewing its lease" in rollout.error
        assert store.finish("a", "2", "succeeded", 1.0, lease=attempt.lease)
        (rollout,) = store.get_rollouts(["a"])
        assert rollout.status == "succeeded" and rollout.attempts == 2
        store.close()
    finally:
        kill(doomed)
        doomed.communicate(timeout=30)
        kill(proc)


# ---------------------------------------------------------------- a service that does not answer


@pytest.fixture
def refusing_url():
    """A URL on 127.0.0.1 whose port is bound but not listening: every connection is refused."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{held.getsockname()[1]}"


def test_a_service_that_refuses_connections_is_retried_then_named(refusing_url, caplog):
    store = HttpStore(refusing_url, connect_timeout_s=1.0)
    with pytest.raises(ConnectionError, match=rf"the store service at {refusing_url} did not answer query for 1 s "
                                              rf"\((\d+) tries; last: ConnectionRefusedError") as raised:
        store.query()
    tries = int(raised.value.args[0].split("(")[1].split(" ")[0])
    assert tries >= 3  # retried with backoff, not given up at the first refusal

    store.add_spans([span("a", "1", 0)])
    with caplog.at_level("ERROR", logger="agl_core.rollout.store_client"):
        store.flush()  # returns: the spans are lost, their attempt ended failed if the service could be told
    assert (f"1 span(s) of rollout a attempt 1 lost: the store service at {refusing_url} did not take them: the "
            f"store service at {refusing_url} did not answer add_spans") in caplog.text
    store.add_spans([span("a", "1", 1)])  # no error outlives its batch: the next upload is tried
    store.flush()
    store.close()


def test_a_service_that_accepts_but_never_answers_is_timed_out_retried_then_named(monkeypatch):
    monkeypatch.setattr("agl_core.rollout.store_client.REQUEST_TIMEOUT_S", 0.2)
    with socket.create_server(("127.0.0.1", 0), backlog=16) as silent:  # the kernel accepts; nobody answers
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        store = HttpStore(url, connect_timeout_s=1.0)
        with pytest.raises(ConnectionError, match=rf"the store service at {url} did not answer heartbeat for 1 s "
                                                  rf"\(\d+ tries; last: (TimeoutError|timeout)"):
            store.heartbeat("a", "1", 30)
        with contextlib.suppress(RuntimeError):
            store.close()
