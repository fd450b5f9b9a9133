"""What one call carries fails that call alone, or is recorded: nesting depth and lone surrogates at every door.

Real processes, files and sockets: the gateway on its server thread over a
real SQLite file (the in-process path) and over ``agl serve store`` (the
service path, through the store client), the test policy endpoint behind it
(a stand-in for a served model, as everywhere in the CPU tests), and a real
``agl train`` whose agent sends bad calls. The cases are drawn from the
class (any depth past the limit, any field, any lone surrogate code point, in
keys and values), with a fixed seed so that a failure reproduces.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from agl_core.config import GatewayConfig
from agl_core.data import Span, Task
from agl_core.gateway import Gateway
from agl_core.http.recordable import MAX_REQUEST_DEPTH, MAX_SPAN_DEPTH
from agl_core.rollout.runner import rollout_metrics
from agl_core.rollout.store import SPANS_LOST, NewRollout
from agl_core.rollout.store_client import HttpStore
from agl_plugin_sqlite.store import SqliteStore

ROOT = Path(__file__).resolve().parents[2]
AGL = shutil.which("agl") or str(Path(sys.executable).with_name("agl"))
MESSAGES = [{"role": "user", "content": "ping"}]
CASES = 12
"""Bad bodies drawn per route."""


@pytest.fixture(params=["sqlite", "service"])
def store(request, tmp_path):
    """The in-process path (a SQLite file) and the service path (``agl serve store`` through its client)."""
    if request.param == "sqlite":
        s = SqliteStore(tmp_path / "rollouts.sqlite")
        yield s
        s.close()
        return
    proc = subprocess.Popen([AGL, "serve", "store", "--db",
                             str(tmp_path / "service.sqlite")], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://"), url
        s = HttpStore(url)
        yield s
        s.close()
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture
def gateway(endpoint, store):
    gw = Gateway(store, GatewayConfig(), sampling={"max_tokens": 8}, upstreams=[endpoint.url])
    server = gw.serve()
    yield server
    server.stop()


def running(store, n: int):
    """``n`` rollouts with a running attempt each: their attempts, by rollout id."""
    store.enqueue([NewRollout(f"r{i}", Task(id=f"t{i}", input={})) for i in range(n)])
    attempts = [store.dequeue("worker", lease_s=300) for _ in range(n)]
    return {a.rollout_id: a for a in attempts}


def url_of(server, attempt, route: str) -> str:
    return Gateway.base_url(server.url, attempt.rollout_id, attempt.attempt_id, attempt.lease) + route


ROUTES = {  # route: a good body, and where in it a bad value may go
    "/chat/completions": ({"model": "m", "messages": MESSAGES}, ["metadata", "messages.0.extra", "tools"]),
    "/completions": ({"model": "m", "prompt": "ping"}, ["metadata", "user_data"]),
    "/messages": ({"model": "m", "max_tokens": 8, "messages": MESSAGES}, ["metadata", "messages.0.extra"]),
    "/responses": ({"model": "m", "input": "ping"}, ["metadata", "text.extra"]),
}


def nested(depth: int, rng: random.Random):
    """A value nested ``depth`` levels deep, each level a list or an object under a random key."""
    value: object = "leaf"
    for _ in range(depth):
        value = [value] if rng.random() < 0.5 else {rng.choice(["a", "properties", "x-y", "é"]): value}
    return value


def nested_json(depth: int, rng: random.Random) -> str:
    """:func:`nested` as JSON text (Python's own encoder stops near 1,000 levels)."""
    opening, closing = [], []
    for _ in range(depth):
        if rng.random() < 0.5:
            opening.append("[")
            closing.append("]")
        else:
            opening.append(json.dumps({rng.choice(["a", "properties", "x-y", "é"]): 0})[:-2])
            closing.append("}")
    return "".join(opening) + '"leaf"' + "".join(reversed(closing))


def lone_surrogate(rng: random.Random) -> str:
    """A JSON escape of a lone UTF-16 surrogate: high or low, alone or next to text."""
    code = rng.choice([0xD800, 0xDBFF, 0xDC00, 0xDFFF, rng.randint(0xD800, 0xDFFF)])
    return rng.choice(["", "hi ", "日本 "]) + f"\\u{code:04x}" + rng.choice(["", " tail", "x"])


def place(body: dict, where: str, value: object, rng: random.Random) -> tuple[dict, str]:
    """``body`` with ``value`` put at ``where`` (``tools``: deep inside a tool's JSON schema); the path the
    gateway must name."""
    body = json.loads(json.dumps(body))
    if where == "tools":
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"p": value}}}}]
        return body, "tools[0].function.parameters.properties.p"
    keys = where.split(".")
    target = body
    for key in keys[:-1]:
        target = target[int(key)] if key.isdigit() else target.setdefault(key, {})
    target[keys[-1]] = value
    return body, "".join(f"[{k}]" if k.isdigit() else f".{k}" for k in keys).lstrip(".")


def bad_bodies(route: str, rng: random.Random):
    """Raw bodies that no store could record, each with the path the 400 must name."""
    good, places = ROUTES[route]
    for _ in range(CASES):
        where = rng.choice(places)
        kind = rng.choice(["deep", "value", "key"])
        mark = "\u2603MARK\u2603"
        if kind == "deep":
            depth = rng.choice([MAX_REQUEST_DEPTH, rng.randint(MAX_REQUEST_DEPTH, 300), rng.randint(300, 5000)])
            body, path = place(good, where, mark, rng)
            raw = json.dumps(body, ensure_ascii=False).replace(f'"{mark}"', nested_json(depth, rng))
            yield raw.encode(), path, "nested"
        else:
            value = {mark: 1} if kind == "key" else [mark] if rng.random() < 0.3 else mark
            body, path = place(good, where, value, rng)
            raw = json.dumps(body, ensure_ascii=False).replace(mark, lone_surrogate(rng))
            yield raw.encode(), path, "surrogate"


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_body_no_store_could_record_gets_a_400_naming_its_path_and_nothing_else_changes(gateway, store, route):
    rng = random.Random(f"door-{route}")
    attempts = running(store, 2)
    bad, good = attempts["r0"], attempts["r1"]
    with httpx.Client(timeout=60) as client:
        for raw, path, what in bad_bodies(route, rng):
            for stream in (False, True):
                body = raw if not stream else raw[:-1] + b', "stream": true}'
                reply = client.post(url_of(gateway, bad, route), content=body,
                                    headers={"content-type": "application/json"})
                assert reply.status_code == 400, (route, path, reply.text)
                assert path.split(".")[0].split("[")[0] in reply.text and what in reply.text, (path, reply.text)
        # The bad calls were refused at the door: the same attempt and another one go on, and are recorded.
        for attempt in (bad, good):
            reply = client.post(url_of(gateway, attempt, route), json=ROUTES[route][0])
            assert reply.status_code == 200, reply.text
    for attempt in (bad, good):
        assert store.finish(attempt.rollout_id, attempt.attempt_id, "succeeded", 1.0, lease=attempt.lease)
    rollouts = store.get_rollouts(["r0", "r1"])
    assert [r.status for r in rollouts] == ["succeeded", "succeeded"]
    assert [len(r.spans) for r in rollouts] == [1, 1], "a refused call must record nothing"


def test_a_body_at_the_depth_limit_is_recorded_and_read_back_as_it_was_sent(gateway, store):
    attempt = running(store, 1)["r0"]
    rng = random.Random("at-the-limit")
    deep = nested(MAX_REQUEST_DEPTH - 2, rng)  # the body's own level and "metadata" make the limit
    text = "ok \U0001f600 日本 \u00e9"  # valid code points beyond the BMP and the ASCII range pass as they are
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "metadata": deep}
    reply = httpx.post(url_of(gateway, attempt, "/chat/completions"), json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert store.finish("r0", attempt.attempt_id, "succeeded", 1.0, lease=attempt.lease)
    (rollout,) = store.get_rollouts(["r0"])
    request = rollout.spans[0].attributes["request"]
    assert request["metadata"] == deep and request["messages"][0]["content"] == text


def test_a_span_no_reader_could_read_is_refused_by_the_store_service_naming_its_path(tmp_path):
    """Spans arriving at ``agl serve store`` straight over HTTP (not through the gateway) are checked too."""
    proc = subprocess.Popen([AGL, "serve", "store", "--db",
                             str(tmp_path / "s.sqlite")], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        url = proc.stdout.readline().strip()
        store = HttpStore(url)
        store.enqueue([NewRollout("a", Task(id="t", input={}))])
        attempt = store.dequeue("w", lease_s=300)
        rng = random.Random("service")
        leases = [{"rollout_id": "a", "attempt_id": attempt.attempt_id, "lease": attempt.lease}]

        def upload(attributes_json: str, sequence_id: int) -> httpx.Response:
            span = Span(rollout_id="a", attempt_id=attempt.attempt_id, sequence_id=sequence_id, kind="llm_call")
            raw = span.model_dump_json().replace('"attributes":{}', f'"attributes":{attributes_json}')
            return httpx.post(f"{url}/v1/store/add_spans", timeout=30,
                              content=b'{"spans":[' + raw.encode() + b'],"leases":' + json.dumps(leases).encode() + b"}")

        for depth in (MAX_SPAN_DEPTH, rng.randint(MAX_SPAN_DEPTH, 250), 400):
            reply = upload(json.dumps({"request": nested(depth, rng)}), store.next_sequence_id("a"))
            assert reply.status_code == 400 and "attributes.request" in reply.text, reply.text
        for _ in range(4):
            reply = upload('{"request": {"content": "' + lone_surrogate(rng) + '"}}', store.next_sequence_id("a"))
            assert reply.status_code == 400 and "attributes.request.content" in reply.text, reply.text
            reply = upload('{"request": {"' + lone_surrogate(rng) + '": 1}}', store.next_sequence_id("a"))
            assert reply.status_code == 400 and "attributes.request" in reply.text, reply.text
        sequence_id = store.next_sequence_id("a")
        assert upload('{"request": {"content": "fine"}}', sequence_id).status_code == 200
        assert store.finish("a", attempt.attempt_id, "succeeded", 1.0, lease=attempt.lease)
        (rollout,) = store.get_rollouts(["a"])
        assert [s.sequence_id for s in rollout.spans] == [sequence_id]
        store.close()
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_full_store_fails_the_rollout_whose_span_it_lost_and_is_written_again_once_room_is_freed(tmp_path,
                                                                                                  endpoint):
    """A real size limit (SQLite's max_page_count, through the store's ``max_bytes``), not a mock: the call
    whose span did not fit is answered (its span is lost on the writer thread), its rollout ends failed and is
    counted; once released rollouts free room, every call is recorded again and nothing stays at 503."""
    store = SqliteStore(tmp_path / "small.sqlite", max_bytes=256 * 1024, keep_consumed=False)
    gw = Gateway(store, GatewayConfig(), sampling={"max_tokens": 8}, upstreams=[endpoint.url])
    server = gw.serve()
    try:
        attempts = running(store, 3)
        filler = []
        for size in (8000, 2000, 500, 50):  # fill the file: enqueue rollouts until not even a small one fits
            while True:
                try:
                    store.enqueue([NewRollout(f"fill{len(filler)}", Task(id="fill", input={"blob": "x" * size}))])
                except Exception as exc:  # noqa: BLE001 - the SQLite error of a full file
                    assert "full" in str(exc), exc
                    break
                filler.append(f"fill{len(filler)}")
        lost = attempts["r0"]  # a call whose span needs pages the file has no room for (a page is 4 KiB)
        big = [{"role": "user", "content": "ping " * 4000}]
        reply = httpx.post(url_of(server, lost, "/chat/completions"), json={"model": "m", "messages": big,
                                                                             "max_tokens": 4}, timeout=60)
        assert reply.status_code == 200, reply.text  # answered: its span is lost later, on the writer thread
        store.flush()
        store.release(filler)  # room again
        for attempt in (attempts["r1"], attempts["r2"]):
            reply = httpx.post(url_of(server, attempt, "/chat/completions"),
                               json={"model": "m", "messages": big, "max_tokens": 4}, timeout=60)
            assert reply.status_code == 200, reply.text
        for attempt in attempts.values():
            store.finish(attempt.rollout_id, attempt.attempt_id, "succeeded", 1.0, lease=attempt.lease)
        rollouts = store.get_rollouts(["r0", "r1", "r2"])
        assert rollouts[0].status == "failed" and rollouts[0].error.startswith(SPANS_LOST), rollouts[0]
        assert [r.status for r in rollouts[1:]] == ["succeeded", "succeeded"]
        assert [len(r.spans) for r in rollouts[1:]] == [1, 1]
        assert rollout_metrics(rollouts)["rollout/n_spans_lost"] == 1.0
    finally:
        server.stop()
        store.close()


BAD_AGENT = '''
import os
from pathlib import Path

import httpx

from examples.guess_number.agent import guess_number

MARKS = Path(os.environ["BAD_CALL_MARKS"])
BODIES = {
    "surrogate": b'{"model": "policy", "messages": [{"role": "user", "content": "hi \\\\ud800"}]}',
    "deep": ('{"model": "policy", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
             '"function": {"name": "f", "parameters": ' + "[" * 280 + "]" * 280 + '}}]}').encode(),
}


def agent(task, llm):
    for kind, body in BODIES.items() if task.split != "val" else ():  # training games: counted in the step
        try:  # the first game to get here sends this bad call (once per run)
            os.close(os.open(MARKS / kind, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            continue
        reply = httpx.post(llm.base_url + "/chat/completions", content=body, timeout=60,
                           headers={"content-type": "application/json", "authorization": f"Bearer {llm.api_key}"})
        (MARKS / kind).write_text(f"{reply.status_code} {reply.text}")
        reply.raise_for_status()
    return guess_number(task, llm)
'''


def test_agl_train_whose_agent_sends_bad_calls_completes_with_only_those_rollouts_failed(agl, tmp_path, run_dir):
    agents, marks = tmp_path / "agents", tmp_path / "marks"
    agents.mkdir()
    marks.mkdir()
    (agents / "bad_call_agent.py").write_text(BAD_AGENT)
    pythonpath = os.pathsep.join(filter(None, [str(agents), str(ROOT), os.environ.get("PYTHONPATH")]))
    result = agl.run("train", agl.GUESS_NUMBER, f"trainer.run_dir={run_dir}", "trainer.total_steps=2",
                     "rollout.n=4", "trainer.test_freq=0", "trainer.save_freq=0", "rollout.agent=bad_call_agent:agent",
                     env={"PYTHONPATH": pythonpath, "BAD_CALL_MARKS": str(marks)}, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    for kind in ("surrogate", "deep"):
        status, _, message = (marks / kind).read_text().partition(" ")
        assert status == "400", message
    assert "lone UTF-16 surrogate" in (marks / "surrogate").read_text()
    assert "tools[0].function.parameters" in (marks / "deep").read_text()
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [s for s in steps if "rollout/n_rollouts" in s]
    assert len(train) == 2, steps
    assert sum(s["rollout/n_failed"] for s in train) == 2, train  # the two bad games, whichever step they fell in
    assert sum(s["rollout/n_succeeded"] for s in train) == sum(s["rollout/n_rollouts"] for s in train) - 2, train
