"""The store service (``agl serve store``) and its client ``HttpStore``: the server's rules, the wire, the plugin.

The store contract over HTTP is in tests/test_store.py; a service killed and
restarted under its clients is in tests/faults/test_fault_store_service.py.
"""

import asyncio
import contextlib
import json
import os
import selectors
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from agl_plugin_sqlite import SqliteStore

from agl_core.components import Components
from agl_core.config import ConfigError
from agl_core.context import TrainContext
from agl_core.data import Span, Task
from agl_core.http.server import ServerThread
from agl_core.rollout.store import SPANS_LOST, LeaseError, NewRollout
from agl_core.rollout.store_client import HttpStore
from agl_core.rollout.store_server import RESERVE_SEQUENCE_IDS, StoreService

TOKEN = "s3cret-token"


@pytest.fixture
def serve(tmp_path):
    """``serve(token=None, max_body_bytes=..., wrap=None) -> (url, backing store)``: a service on a real file."""
    opened = []

    def start(token=None, wrap=None, **options):
        backing = SqliteStore(tmp_path / f"store{len(opened)}.sqlite", reserve_sequence_ids=RESERVE_SEQUENCE_IDS)
        service = StoreService(backing, token, **options)
        server = (service.server() if wrap is None else
                  ServerThread(wrap(service.app))).start()
        opened.append((server, service, backing))
        return server.url, backing

    yield start
    for server, service, backing in opened:
        server.stop()
        service.close()
        backing.close()


@pytest.fixture
def client():
    """``client(url, **options)``: an HttpStore closed after the test."""
    made = []

    def make(url, **options):
        made.append(HttpStore(url, **{"connect_timeout_s": 10, **options}))
        return made[-1]

    yield make
    for store in made:
        with contextlib.suppress(Exception):  # a test may have left it failing on purpose
            store.close()


def new(rollout_id, **metadata):
    return NewRollout(rollout_id, Task(id=f"task-{rollout_id}", input={"q": rollout_id}), 0, 2, metadata)


def span(rollout_id, attempt_id, sequence_id):
    return Span(rollout_id=rollout_id, attempt_id=attempt_id, sequence_id=sequence_id, kind="llm_call",
                prompt_token_ids=list(range(20)), response_token_ids=[sequence_id], response_logprobs=[-0.5])


def post(url, method, body, token=None):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{url}/v1/store/{method}", content=content, headers=headers, timeout=10)


# ---------------------------------------------------------------- a real `agl serve store` process


def agl(*args):
    exe = shutil.which("agl") or str(Path(sys.executable).with_name("agl"))
    return [exe, *map(str, args)]


def first_line(proc, timeout_s=60.0):
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    assert selector.select(timeout_s), f"agl serve store printed nothing in {timeout_s} s"
    line = proc.stdout.readline().strip()
    assert line, f"agl serve store exited (rc={proc.wait(10)}): {proc.stderr.read()}"
    return line


def test_agl_serve_store_serves_a_file_until_sigterm_then_closes_it_with_every_span(tmp_path, client):
    db = tmp_path / "rollouts.sqlite"
    proc = subprocess.Popen(agl("serve", "store", "--db", db), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={k: v for k, v in os.environ.items() if k != "AGL_STORE_TOKEN"})
    try:
        url = first_line(proc)
        assert url.startswith("http://127.0.0.1:")
        store = client(url)
        store.enqueue([new("a"), new("b")])
        attempt = store.dequeue("w", lease_s=30, wait_s=5)
        ids = [store.next_sequence_id("a") for _ in range(600)]  # more than a batch and a reserved block
        store.add_spans([span("a", attempt.attempt_id, i) for i in ids], leases={("a", "1"): attempt.lease})
        assert store.finish("a", attempt.attempt_id, "succeeded", final_reward=1.0, lease=attempt.lease)
        assert store.wait(["a"], timeout_s=5) == {"a"}
        store.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, proc.stderr.read()
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    reopened = SqliteStore(db)
    try:
        (rollout,) = reopened.get_rollouts(["a"])
        assert rollout.status == "succeeded" and [s.sequence_id for s in rollout.spans] == list(range(600))
        assert [r.rollout_id for r in reopened.query(["queuing"])] == ["b"]
    finally:
        reopened.close()


@pytest.mark.parametrize(("args", "message"), [
    (["--host", "0.0.0.0"], "the store service binds 0.0.0.0, which is not a loopback address: set --token "
                            "(or $AGL_STORE_TOKEN)"),
    (["--port", "{port}"], "--port: the store service cannot listen on 127.0.0.1:{port}"),
    (["--db", "{tmp}"], "the SQLite store {tmp} cannot be used: it is a directory"),
])
def test_agl_serve_store_refuses_to_start_naming_the_problem(tmp_path, args, message):
    with socket.create_server(("127.0.0.1", 0)) as taken:  # a port in use
        port = taken.getsockname()[1]
        args = [a.format(port=port, tmp=tmp_path) for a in args]
        message = message.format(port=port, tmp=tmp_path)
        db = [] if "--db" in args else ["--db", tmp_path / "rollouts.sqlite"]
        env = {k: v for k, v in os.environ.items() if k != "AGL_STORE_TOKEN"}
        done = subprocess.run(agl("serve", "store", *db, *args), capture_output=True, text=True, timeout=120,
                              env=env)
    assert done.returncode == 2 and f"agl: error: {message}" in done.stderr, done.stderr
    assert done.stdout == ""


# ---------------------------------------------------------------- the token


def test_a_wrong_or_missing_token_is_refused_with_401_and_nothing_is_written(serve, client):
    url, backing = serve(token=TOKEN)
    body = {"rollouts": [{"rollout_id": "a", "task": {"id": "t", "input": {}}}]}
    for token in (None, "wrong", TOKEN[:-1], TOKEN + "x"):
        answer = post(url, "enqueue", body, token)
        assert answer.status_code == 401 and "missing or wrong bearer token" in answer.json()["error"]["message"]
    assert backing.query() == []

    with pytest.raises(PermissionError, match=f"the store service at {url} \\(enqueue\\) refused the request"):
        client(url, token="wrong").enqueue([new("a")])
    spans_writer = client(url, token="wrong")
    spans_writer.add_spans([span("a", "1", 0)])
    spans_writer.flush()  # refused: lost, and logged
    assert backing.query() == [] and backing.get_rollouts(["a"]) == []

    right = client(url, token=TOKEN)
    right.enqueue([new("a")])
    assert [r.rollout_id for r in right.query()] == ["a"]


def test_the_token_comes_from_the_environment(serve, client, monkeypatch):
    url, _ = serve(token=TOKEN)
    monkeypatch.setenv("AGL_STORE_TOKEN", TOKEN)
    assert client(url).query() == []


def test_healthz_answers_without_the_token_and_tells_more_with_it(serve):
    url, backing = serve(token=TOKEN)
    assert httpx.get(f"{url}/healthz", timeout=10).json() == {"ok": True}
    with_token = httpx.get(f"{url}/healthz", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).json()
    assert with_token == {"ok": True, "db": str(backing.path)}


# ---------------------------------------------------------------- bad requests fail alone


def test_a_body_over_the_limit_is_refused_with_413(serve):
    url, backing = serve(max_body_bytes=1024)
    body = {"rollouts": [{"rollout_id": "a", "task": {"id": "t", "input": {"x": "y" * 2000}}}]}
    answer = post(url, "enqueue", body)
    assert answer.status_code == 413 and "exceeds 1024 bytes" in answer.json()["error"]["message"]
    assert backing.query() == []


def test_a_trickling_body_is_answered_408_and_others_are_served_meanwhile(serve):
    url, backing = serve(body_timeout_s=0.5)
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as slow:
        slow.sendall(b"POST /v1/store/query HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        assert post(url, "query", {}).status_code == 200  # served while the slow body is still due
        answer = slow.recv(65536)
    assert answer.startswith(b"HTTP/1.1 408") and b"not received within 0.5 s" in answer


def test_stopping_the_server_lets_the_request_in_flight_finish(tmp_path):
    backing = SqliteStore(tmp_path / "store.sqlite", reserve_sequence_ids=RESERVE_SEQUENCE_IDS)
    service = StoreService(backing)
    server = service.server().start()
    answers = []
    poll = threading.Thread(target=lambda: answers.append(post(server.url, "dequeue", {
        "worker_id": "w", "lease_s": 10, "wait_s": 1.0})))
    poll.start()
    deadline = time.monotonic() + 10
    while not server._server.server_state.tasks:  # until the long poll is waiting at the service (uvicorn's own count)
        assert time.monotonic() < deadline, "the dequeue never reached the service"
        time.sleep(0.01)
    server.stop()
    poll.join(10)
    service.close()
    backing.close()
    assert [answer.status_code for answer in answers] == [200]
    assert answers[0].json() == {"attempt": None}


@pytest.mark.parametrize(("method", "body", "status", "message"), [
    ("dequeue", {"worker_id": "w"}, 400, "dequeue: lease_s: Field required"),
    ("dequeue", {"worker_id": "w", "lease_s": -1}, 400, "dequeue: lease_s: Input should be greater than 0"),
    ("dequeue", {"worker_id": "w", "lease_s": 30, "wait": 1}, 400, "dequeue: wait: unknown field"),
    ("enqueue", {"rollouts": [{"rollout_id": "b", "task": {"id": "t"}}]}, 400, "enqueue: rollouts.0.task.input: "
                                                                               "Field required"),
    ("enqueue", {"rollouts": [{"rollout_id": "a", "task": {"id": "t", "input": {}}}]}, 400,
     "rollouts already in the store: ['a']"),
    ("add_spans", {"spans": [{"rollout_id": "a", "sequence_id": 0, "kind": "nope"}]}, 400,
     "add_spans: spans.0.kind: Input should be 'llm_call', 'reward' or 'annotation'"),
    ("finish", {"rollout_id": "a", "attempt_id": "1", "status": "running"}, 400,
     "finish needs a terminal status"),
    ("wait", {"rollout_ids": ["a"], "timeout_s": "soon"}, 400, "wait: timeout_s: Input should be a valid number"),
    ("query", b"{not json", 400, "request body is not valid JSON"),
    ("query", b"[]", 400, "request body must be a JSON object"),
    ("nope", {}, 404, "no store method 'nope'; methods: enqueue, dequeue"),
])
def test_a_bad_request_gets_a_4xx_naming_what_is_wrong_and_changes_nothing(serve, method, body, status, message):
    url, backing = serve()
    backing.enqueue([new("a")])
    answer = post(url, method, body)
    assert answer.status_code == status and message in answer.json()["error"]["message"], answer.text
    (rollout,) = backing.query()
    assert (rollout.rollout_id, rollout.status) == ("a", "queuing")
    assert backing.get_rollouts(["a"])[0].spans == []


def test_the_client_raises_the_protocols_errors(serve, client):
    url, _ = serve()
    store = client(url)
    with pytest.raises(KeyError, match="'nope' is not in the store"):
        store.next_sequence_id("nope")
    store.enqueue([new("a")])
    store.release(["a"])
    with pytest.raises(KeyError, match="it was released"):
        store.next_sequence_id("a")
    with pytest.raises(ValueError, match=f"the store service at {url} \\(enqueue\\): rollouts already in the store"):
        store.enqueue([new("a")])
    with pytest.raises(ValueError, match="finish needs a terminal status"):
        store.finish("a", "1", "running")
    store.enqueue([new("b")])
    attempt = store.dequeue("w", 30)
    rid = attempt.rollout_id
    with pytest.raises(LeaseError, match=f"attempt '1' of rollout '{rid}' is leased under another token"):
        store.finish(rid, "1", "succeeded", lease="not-the-token")
    with pytest.raises(LeaseError, match="is leased under another token"):
        store.admit(rid, "1", 1, lease=attempt.lease[:-1])


def test_a_closed_client_says_so(serve):
    url, _ = serve()
    store = HttpStore(url)
    store.close()
    for call in (store.query, lambda: store.add_spans([span("a", "1", 0)])):
        with pytest.raises(RuntimeError, match=f"the client of the store service at {url} is closed"):
            call()


class _CountedWrites:
    """A socket that counts the writes made on it (and does them)."""

    def __init__(self, sock):
        self.sock, self.writes = sock, []

    def sendall(self, data, *args):
        self.writes.append(bytes(data))
        return self.sock.sendall(data, *args)

    def send(self, data, *args):
        self.writes.append(bytes(data))
        return self.sock.send(data, *args)

    def __getattr__(self, name):
        return getattr(self.sock, name)


def test_each_request_leaves_in_one_write_head_and_body(serve, client):
    """http.client writes a request's head and body apart (two packets with TCP_NODELAY: two wake-ups of the
    service); the client sends them in one write, each request on its kept-alive connection."""
    url, backing = serve()
    store = client(url)
    store.enqueue([new("a")])  # opens this thread's connection
    conn = store._local.conn
    counted = conn.sock = _CountedWrites(conn.sock)
    attempt = store.dequeue("w", 30)
    assert store.heartbeat("a", attempt.attempt_id, 30, lease=attempt.lease)
    assert len(counted.writes) == 2
    for write, method in zip(counted.writes, ("dequeue", "heartbeat")):
        head, _, body = write.partition(b"\r\n\r\n")
        assert head.startswith(f"POST /v1/store/{method} HTTP/1.1".encode())
        assert json.loads(body)["worker_id" if method == "dequeue" else "lease"]
    assert backing.get_rollouts(["a"])[0].status == "running"


def self_signed_certificate(directory):
    """A certificate for 127.0.0.1 and its key, written as PEM files in ``directory``: (certfile, keyfile)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    certfile, keyfile = directory / "cert.pem", directory / "key.pem"
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return certfile, keyfile


def test_an_https_url_speaks_tls_and_checks_the_services_certificate(tmp_path, monkeypatch):
    certfile, keyfile = self_signed_certificate(tmp_path)
    backing = SqliteStore(tmp_path / "tls.sqlite")
    service = StoreService(backing)
    server = service.server()
    # ServerThread serves plain HTTP; uvicorn's own TLS settings are set on its config before it starts
    server._server.config.ssl_certfile, server._server.config.ssl_keyfile = str(certfile), str(keyfile)
    server.start()
    url = server.url.replace("http://", "https://")
    clients = []
    try:
        clients.append(HttpStore(url, connect_timeout_s=0.5))
        with pytest.raises(ConnectionError, match=f"the store service at {url} did not answer query.*CERTIFICATE"):
            clients[-1].query()  # a certificate no authority it trusts signed
        monkeypatch.setenv("SSL_CERT_FILE", str(certfile))  # OpenSSL's trusted authorities, read per TLS context
        store = HttpStore(url, connect_timeout_s=10)
        clients.append(store)
        store.enqueue([new("a")])
        attempt = store.dequeue("w", 30)
        store.add_spans([span("a", attempt.attempt_id, 0)], leases={("a", attempt.attempt_id): attempt.lease})
        assert store.finish("a", attempt.attempt_id, "succeeded", final_reward=1.0, lease=attempt.lease)
        [rollout] = store.get_rollouts(["a"])
        assert (rollout.status, len(rollout.spans)) == ("succeeded", 1)
        clients.append(HttpStore(server.url, connect_timeout_s=0.5))
        with pytest.raises(ConnectionError, match="did not answer query"):
            clients[-1].query()  # plain HTTP to a TLS port
    finally:
        for made in clients:  # before the server stops: it waits for open connections
            made.close()
        server.stop()
        service.close()
        backing.close()


@pytest.mark.parametrize("url", ["localhost:8765", "ftp://host:1", "http://host:1/v1", "http://:80",
                                 "http://host:99999"])
def test_a_url_that_is_not_a_services_is_refused_naming_it(url):
    with pytest.raises(ValueError, match=f"the store service URL '{url}'"):
        HttpStore(url)


# ---------------------------------------------------------------- retried calls


def losing_answers(methods, times=1):
    """An ASGI wrapper: the first ``times`` answers to each of ``methods`` are applied, then lost (a 503 instead)."""
    lost = {method: 0 for method in methods}

    def wrap(app):
        async def wrapped(scope, receive, send):
            method = scope.get("path", "").rsplit("/", 1)[-1]
            if scope["type"] != "http" or lost.get(method, times) >= times:
                return await app(scope, receive, send)
            lost[method] += 1

            async def drop(message):
                pass
            await app(scope, receive, drop)  # applied; its answer never leaves
            await send({"type": "http.response.start", "status": 503, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"lost"})
        return wrapped

    return wrap, lost


def test_calls_whose_answer_was_lost_are_retried_without_doubling_anything(serve, client):
    wrap, lost = losing_answers(["enqueue", "finish", "add_spans", "next_sequence_id"])
    url, backing = serve(wrap=wrap)
    store = client(url, batch_size=2)
    store.enqueue([new("a", agent_name="x"), new("b")])  # applied, answer lost, retried: no error
    attempt = store.dequeue("w", 30)
    ids = [store.next_sequence_id("a") for _ in range(3)]
    assert ids == [1, 2, 3]  # the id of the lost answer is skipped, never reused
    # the first batch is written, its answer lost, resent
    store.add_spans([span("a", "1", i) for i in ids], leases={("a", "1"): attempt.lease})
    assert store.finish("a", attempt.attempt_id, "succeeded", 1.0, lease=attempt.lease)  # answer lost: still True
    assert lost == {"enqueue": 1, "finish": 1, "add_spans": 1, "next_sequence_id": 1}
    (rollout,) = store.get_rollouts(["a"])
    assert rollout.status == "succeeded" and [s.sequence_id for s in rollout.spans] == ids
    with contextlib.closing(sqlite3.connect(backing.path)) as conn:
        assert conn.execute("SELECT COUNT(*) FROM spans").fetchone()[0] == 3
    # a finish that did not end the attempt says so, retried or not
    assert not store.finish("a", attempt.attempt_id, "failed", lease=attempt.lease)


def test_an_enqueue_retried_into_different_rollouts_still_fails(serve, client):
    wrap, _ = losing_answers(["enqueue"])
    url, backing = serve(wrap=wrap)
    backing.enqueue([new("a", agent_name="other")])
    with pytest.raises(ValueError, match="already in the store"):
        client(url).enqueue([new("a", agent_name="mine")])


def test_long_polls_are_cut_by_the_service_and_resumed_by_the_client(serve, client, monkeypatch):
    monkeypatch.setattr("agl_core.rollout.store_server.LONG_POLL_S", 0.05)
    url, backing = serve()
    store = client(url)
    backing.enqueue([new("a")])
    attempt = store.dequeue("w", 30)
    threading.Timer(0.3, lambda: backing.finish("a", attempt.attempt_id, "succeeded", lease=attempt.lease)).start()
    assert store.wait(["a"], timeout_s=30) == {"a"}  # many cut polls, one answer
    assert store.dequeue("w", 30, wait_s=0.2) is None


def test_spans_are_uploaded_in_batches_each_once(serve, client):
    url, backing = serve()
    store = client(url, batch_size=7, batch_bytes=2000)
    store.enqueue([new("a")])
    attempt = store.dequeue("w", 30)
    for _ in range(10):
        store.add_spans([span("a", attempt.attempt_id, store.next_sequence_id("a")) for _ in range(10)],
                        leases={("a", "1"): attempt.lease})
    store.flush()
    assert [s.sequence_id for s in backing.get_rollouts(["a"])[0].spans] == list(range(100))


def test_spans_waiting_for_upload_ride_on_the_next_admit_and_go_back_when_it_is_refused(serve, client):
    """While the uploader is busy (its first upload held 1.5 s), the spans added after it ride on the next admit;
    an admit refused (n=0) gives its spans back to the uploader: every span in the file once."""
    requests, busy = [], threading.Event()

    def wrap(app):
        async def wrapped(scope, receive, send):
            message = await receive()
            method = scope["path"].rsplit("/", 1)[-1]
            requests.append((method, len(json.loads(message["body"]).get("spans", []))))
            if method == "add_spans" and not busy.is_set():
                busy.set()
                await asyncio.sleep(1.5)

            async def again():
                return message
            await app(scope, again, send)
        return wrapped

    url, backing = serve(wrap=wrap)
    store = client(url)
    store.enqueue([new("a")])
    attempt = store.dequeue("w", 30)
    leases = {("a", "1"): attempt.lease}
    _, ids = store.admit("a", attempt.attempt_id, 4, lease=attempt.lease)
    store.add_spans([span("a", attempt.attempt_id, ids[0])], leases=leases)
    assert busy.wait(5)  # the uploader is held with span 0
    store.add_spans([span("a", attempt.attempt_id, i) for i in ids[1:3]], leases=leases)
    store.admit("a", attempt.attempt_id, 1, lease=attempt.lease)
    store.add_spans([span("a", attempt.attempt_id, ids[3])], leases=leases)
    with pytest.raises(ValueError, match="admit: n: Input should be greater than or equal to 1"):
        store.admit("a", attempt.attempt_id, 0, lease=attempt.lease)
    assert [r for r in requests if r[0] == "admit"] == [("admit", 0), ("admit", 2), ("admit", 1), ("admit", 0)]
    store.flush()  # span 3 went back to the uploader
    assert [s.sequence_id for s in backing.get_rollouts(["a"])[0].spans] == ids
    with contextlib.closing(sqlite3.connect(backing.path)) as conn:
        assert conn.execute("SELECT COUNT(*) FROM spans").fetchone()[0] == 4


def recording(requests, hold_first_upload=None):
    """An ASGI wrapper that notes (method, spans carried) of each request; the first ``add_spans`` waits until
    ``hold_first_upload`` (an Event) is set, when given."""

    def wrap(app):
        async def wrapped(scope, receive, send):
            message = await receive()
            method = scope["path"].rsplit("/", 1)[-1]
            requests.append((method, [s["sequence_id"] for s in json.loads(message["body"]).get("spans", [])]))
            if method == "add_spans" and hold_first_upload is not None and not hold_first_upload.is_set():
                while not hold_first_upload.is_set():
                    await asyncio.sleep(0.01)

            async def again():
                return message
            await app(scope, again, send)
        return wrapped

    return wrap


def test_a_runners_spans_ride_on_its_finish_after_those_on_their_way(serve, client):
    """The spans a runner added (an emitted reward) ride on its finish instead of an upload of their own; spans
    already on their way (an upload held by the service) are acknowledged before the finish is sent."""
    requests, release = [], threading.Event()
    url, backing = serve(wrap=recording(requests, hold_first_upload=release))
    store = client(url)
    store.enqueue([new("a"), new("b")])
    attempt = store.dequeue("w", 30)
    leases = {("a", attempt.attempt_id): attempt.lease}
    ids = [store.next_sequence_id("a") for _ in range(3)]
    store.add_spans([span("a", attempt.attempt_id, ids[0])], leases=leases)
    deadline = time.monotonic() + 5
    while ("add_spans", [ids[0]]) not in requests:  # span 0 is on its way, held by the service
        assert time.monotonic() < deadline
        time.sleep(0.01)
    store.add_spans([span("a", attempt.attempt_id, i) for i in ids[1:]], leases=leases)
    threading.Timer(0.3, release.set).start()
    assert store.finish("a", attempt.attempt_id, "succeeded", 1.0, lease=attempt.lease)
    assert requests[-2:] == [("add_spans", [ids[0]]), ("finish", ids[1:])]  # the finish waited for span 0
    (rollout,) = backing.get_rollouts(["a"])
    assert rollout.status == "succeeded" and [s.sequence_id for s in rollout.spans] == ids

    other = store.dequeue("w", 30)  # nothing waits: a finish without spans
    assert store.finish("b", other.attempt_id, "succeeded", 0.0, lease=other.lease)
    assert requests[-1] == ("finish", [])


def test_a_finish_refused_with_spans_riding_on_it_gives_them_back_and_is_asked_again(serve, client, caplog):
    """A finish whose spans the service refuses (one of an ended attempt, under an id never handed out) is refused
    whole; its spans go back to the uploader, which loses the refused span alone (its loss logged), and the finish
    is made again without them."""
    requests, release = [], threading.Event()
    url, backing = serve(wrap=recording(requests, hold_first_upload=release))
    store = client(url)
    store.enqueue([new("a"), new("b")])
    a, b = store.dequeue("w", 30), store.dequeue("w", 30)
    assert store.finish("b", b.attempt_id, "succeeded", 1.0, lease=b.lease)
    ids = [store.next_sequence_id("a") for _ in range(2)]
    leases = {("a", a.attempt_id): a.lease, ("b", b.attempt_id): b.lease}
    store.add_spans([span("a", a.attempt_id, ids[0])], leases=leases)
    deadline = time.monotonic() + 5
    while ("add_spans", [ids[0]]) not in requests:  # held by the service: the spans below wait for the finish
        assert time.monotonic() < deadline
        time.sleep(0.01)
    store.add_spans([span("a", a.attempt_id, ids[1]), span("b", b.attempt_id, 10_000)], leases=leases)
    threading.Timer(0.3, release.set).start()
    with caplog.at_level("ERROR", logger="agl_core.rollout.store_client"):
        assert store.finish("a", a.attempt_id, "succeeded", 1.0, lease=a.lease)
    refused = requests.index(("finish", [ids[1], 10_000]))  # then the uploader's (b's loss ends it: no-op)
    assert requests[refused + 1:] == [("add_spans", [ids[1], 10_000]), ("add_spans", [ids[1]]),
                                      ("add_spans", [10_000]), ("finish", []), ("finish", [])]
    (rollout,) = backing.get_rollouts(["a"])
    assert rollout.status == "succeeded" and [s.sequence_id for s in rollout.spans] == ids
    assert backing.get_rollouts(["b"])[0].spans == []
    assert "1 span(s) of rollout b attempt 1 lost" in caplog.text


# ---------------------------------------------------------------- the plugin


def test_the_plugin_opens_an_http_store_at_its_url(make_recipe, serve, tmp_path):
    url, backing = serve(token=TOKEN)
    recipe, plugins = make_recipe(["rollout.store=http", f"plugins.http_store.url={url}",
                                   f"plugins.http_store.token={TOKEN}", "plugins.http_store.connect_timeout_s=5"])
    components = Components.collect(plugins)
    ctx = TrainContext(recipe, plugins, components, Path(recipe.trainer.run_dir))
    store = components.get("store", "http").obj(ctx)
    try:
        store.enqueue([new("a")])
        assert isinstance(store, HttpStore) and store.connect_timeout_s == 5
        assert [r.rollout_id for r in backing.query()] == ["a"]
    finally:
        store.close()


def test_the_plugin_needs_a_url(make_recipe):
    recipe, plugins = make_recipe(["rollout.store=http"])
    components = Components.collect(plugins)
    ctx = TrainContext(recipe, plugins, components, Path(recipe.trainer.run_dir))
    with pytest.raises(ConfigError, match="set plugins.http_store.url"):
        components.get("store", "http").obj(ctx)
    with pytest.raises(ConfigError, match="plugins.http_store.urll: unknown key"):
        make_recipe(["plugins.http_store.urll=http://x:1"])


def test_finish_waits_for_the_spans_of_the_calls_the_service_admitted(serve, client, monkeypatch):
    """A gateway answers a call before its spans are uploaded, so the runner's finish may overtake them: the service
    makes finish wait for the spans of the calls it admitted, and never for a timed-out attempt's calls."""
    url, _ = serve()
    trainer, runner, gateway = client(url), client(url), client(url)
    trainer.enqueue([new("a"), new("b")])
    attempt = runner.dequeue("w", lease_s=30)
    leases = {("a", "1"): attempt.lease}
    _, [first, second] = gateway.admit("a", attempt.attempt_id, 2, lease=attempt.lease)
    gateway.add_spans([span("a", attempt.attempt_id, first)], leases=leases)
    late = threading.Timer(0.3, lambda: gateway.add_spans([span("a", attempt.attempt_id, second)], leases=leases))
    late.start()
    assert runner.finish("a", attempt.attempt_id, "succeeded", final_reward=1.0, lease=attempt.lease)
    assert [s.sequence_id for s in trainer.get_rollouts(["a"])[0].spans] == [first, second]
    late.join()

    other = runner.dequeue("w", lease_s=30)
    gateway.admit("b", other.attempt_id, 1, lease=other.lease)  # a call whose span never comes: its gateway stopped
    monkeypatch.setattr("agl_core.rollout.store_server.SPAN_WAIT_S", 0.2)
    assert runner.finish("b", other.attempt_id, "timed_out", lease=other.lease)  # not waited for
    assert trainer.get_rollouts(["b"])[0].spans == []


def test_a_finish_gives_up_on_a_span_that_never_comes_and_the_attempt_ends_failed(serve, client, monkeypatch,
                                                                                   caplog):
    url, _ = serve()
    store = client(url)
    store.enqueue([new("a")])
    attempt = store.dequeue("w", lease_s=30)
    store.admit("a", attempt.attempt_id, 1, lease=attempt.lease)
    monkeypatch.setattr("agl_core.rollout.store_server.SPAN_WAIT_S", 0.2)
    with caplog.at_level("WARNING", logger="agl_core.rollout.store_server"):
        assert store.finish("a", attempt.attempt_id, "succeeded", final_reward=1.0, lease=attempt.lease)
    assert "ended without the spans of calls [0]" in caplog.text
    (rollout,) = store.get_rollouts(["a"])
    assert rollout.status == "failed" and rollout.error.startswith(SPANS_LOST), rollout


def test_long_polls_answer_at_once_what_is_there_and_wait_for_the_rest(serve, client):
    url, _ = serve()
    store, producer = client(url), client(url)
    store.enqueue([new("a")])
    assert store.dequeue("w", lease_s=30, wait_s=5).rollout_id == "a"  # there: answered on the event loop
    threading.Timer(0.3, lambda: producer.enqueue([new("b")])).start()
    leased = store.dequeue("w", lease_s=30, wait_s=5)
    assert leased.rollout_id == "b"  # not yet there: waited for on the pool
    threading.Timer(0.3, lambda: producer.finish("b", "1", "succeeded", lease=leased.lease)).start()
    assert store.wait(["b"], timeout_s=5) == {"b"}
