"""Each runner acts only on what it holds: lease tokens against a real ``agl serve store``, and the gateway's admin
route against a real ``agl serve gateway``, both spoken to over raw HTTP on 127.0.0.1 as any client could."""

from __future__ import annotations

import httpx
import pytest

from agl_core.data import Span

STORE_TOKEN = "store-secret"
AGENTS_TOKEN, ADMIN_TOKEN = "agents-secret", "admin-secret"


def printed_url(agl, log, prefix="http://"):
    return agl.wait_until(lambda: next((line.strip() for line in log.read_text().splitlines()
                                        if line.startswith(prefix)), None), 60, f"a URL in {log}")


@pytest.fixture
def services(agl, tmp_path):
    """``agl serve store`` (token STORE_TOKEN) and ``agl serve gateway`` over it (agents' and admin tokens)."""
    procs = []

    def spawn(name, *args, env=None):
        log = tmp_path / f"{name}.log"
        procs.append(agl.spawn(*args, env=env, log=log))
        return printed_url(agl, log)

    store = spawn("store", "serve", "store", "--db", tmp_path / "store.sqlite", env={"AGL_STORE_TOKEN": STORE_TOKEN})
    gateway = spawn("gateway", "serve", "gateway", "--store", store, "--token", AGENTS_TOKEN, "--upstream",
                    "http://127.0.0.1:9/v1", env={"AGL_STORE_TOKEN": STORE_TOKEN,
                                                  "AGL_GATEWAY_ADMIN_TOKEN": ADMIN_TOKEN})
    yield store, gateway
    for proc in procs:
        proc.terminate()
        proc.wait(30)


def call(store, method, body):
    return httpx.post(f"{store}/v1/store/{method}", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {STORE_TOKEN}"})


def span_json(rollout_id, attempt_id, sequence_id, **attributes):
    return Span(rollout_id=rollout_id, attempt_id=attempt_id, sequence_id=sequence_id, kind="llm_call",
                attributes=attributes).model_dump(mode="json")


def refused(answer) -> bool:
    return answer.status_code == 409 and answer.json()["error"]["type"] == "lease"


def test_a_holder_of_the_store_token_acts_only_on_the_attempts_it_leased(services):
    store, _ = services
    task = {"id": "t", "input": {}}
    assert call(store, "enqueue", {"rollouts": [{"rollout_id": "a", "task": task},
                                                {"rollout_id": "b", "task": task}]}).status_code == 200
    attempt = call(store, "dequeue", {"worker_id": "mine", "lease_s": 60}).json()["attempt"]
    lease = attempt["lease"]
    assert attempt["rollout_id"] == "a" and len(lease) >= 20
    key = {"rollout_id": "a", "attempt_id": "1"}

    for other in (None, "guess", lease[:-1] + ("x" if lease[-1] != "x" else "y")):  # none, wrong, one char off
        assert refused(call(store, "heartbeat", {**key, "lease_s": 60, "lease": other}))
        assert refused(call(store, "finish", {**key, "status": "succeeded", "final_reward": 9.0, "lease": other}))
        assert refused(call(store, "admit", {**key, "n": 1, "lease": other}))
        answer = call(store, "add_spans", {"spans": [span_json("a", "1", 90)],
                                           "leases": [{**key, "lease": other}]})
        assert refused(answer), answer.text
    assert refused(call(store, "add_spans", {"spans": [span_json("a", "1", 91)]}))  # no token at all
    state = call(store, "attempt_state", key).json()["state"]
    assert state["current"] and state["rollout_status"] == "running"  # nothing changed

    # Spans of an attempt that does not run: unknown rollout, unknown attempt, a rollout still queued.
    for rollout_id, attempt_id in (("nope", "1"), ("a", "2"), ("b", "1")):
        answer = call(store, "add_spans", {"spans": [span_json(rollout_id, attempt_id, 0)], "leases": [
            {"rollout_id": rollout_id, "attempt_id": attempt_id, "lease": lease}]})
        assert refused(answer), answer.text

    # The holder's spans: the first under an id wins, the same again is idempotent, another one is a 409.
    ids = call(store, "admit", {**key, "n": 1, "lease": lease}).json()["sequence_ids"]
    mine = [{**key, "lease": lease}]
    first = span_json("a", "1", ids[0], text="first")
    assert call(store, "add_spans", {"spans": [first], "leases": mine}).json() == {"count": 1}
    assert call(store, "add_spans", {"spans": [first], "leases": mine}).json() == {"count": 1}
    answer = call(store, "add_spans", {"spans": [span_json("a", "1", ids[0], text="second")], "leases": mine})
    assert refused(answer) and "already holds another span under sequence id" in answer.json()["error"]["message"]

    assert call(store, "heartbeat", {**key, "lease_s": 60, "lease": lease}).json() == {"ok": True}
    assert call(store, "finish", {**key, "status": "succeeded", "final_reward": 1.0, "lease": lease}).json() == \
        {"ok": True}
    # Ended: a span under an id never handed out while it ran is refused, with the holder's token too.
    assert refused(call(store, "add_spans", {"spans": [span_json("a", "1", ids[0] + 5)], "leases": mine}))
    assert call(store, "finish", {**key, "status": "failed", "lease": lease}).json() == {"ok": False}
    (rollout,) = call(store, "get_rollouts", {"rollout_ids": ["a"]}).json()["rollouts"]
    assert (rollout["status"], rollout["final_reward"]) == ("succeeded", 1.0)
    assert [(s["sequence_id"], s["attributes"].get("text")) for s in rollout["spans"]] == [(ids[0], "first")]


def test_the_gateways_admin_route_refuses_the_agents_key(services):
    _, gateway = services
    body = {"urls": ["http://127.0.0.1:8/v1"], "weight_version": 5}
    for token in (None, "wrong", AGENTS_TOKEN):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        answer = httpx.put(f"{gateway}/v1/admin/policy", json=body, headers=headers, timeout=30)
        assert answer.status_code == 401, answer.text
    health = httpx.get(f"{gateway}/healthz", headers={"Authorization": f"Bearer {AGENTS_TOKEN}"}, timeout=30)
    assert health.json()["upstreams"] == ["http://127.0.0.1:9/v1"]  # unchanged
    answer = httpx.put(f"{gateway}/v1/admin/policy", json=body, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                       timeout=30)
    assert answer.status_code == 200 and answer.json()["urls"] == body["urls"]
