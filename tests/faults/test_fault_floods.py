"""Floods: one client cannot take a service down. Each service runs in a process of its own on 127.0.0.1: the store
service (``agl serve store``), the gateway (``agl serve gateway`` over a store service) and the torch plugin's policy
endpoint (its serving process). Against each, a flood client — pipelining without reading, an endless header line,
slowloris header trickles, idle connections up to the cap — while a second client checks that the service answers.

The limits are those of :mod:`agl_core.http.limits` (64 KiB and 10 s of header section, 16 requests read ahead);
the connection cap is set small here (:data:`CAP`), as an operator would set it.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psutil
import pytest

from agl_core.http.limits import ServerLimits

CAP = 24
HEADER_LIMITS = ServerLimits()
REQUEST = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


def _serve(log, *args):
    """``agl serve ARGS --max-connections CAP`` as a process, and the URL it printed once it serves."""
    agl = shutil.which("agl") or str(Path(sys.executable).with_name("agl"))
    proc = subprocess.Popen([agl, "serve", *map(str, args), "--max-connections", str(CAP)],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)  # noqa: SIM115 - the child owns it
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"agl serve {args[0]} exited ({proc.returncode}): {log.read_text()}"
        url = next((line for line in log.read_text().splitlines() if line.startswith("http://")), None)
        if url:
            return proc, url
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"agl serve {args[0]} did not print its URL within 120 s")


@pytest.fixture(scope="module", params=["store service", "gateway", "policy endpoint"])
def service(request, tmp_path_factory):
    """(URL, pid) of a running service of each kind, its connection cap :data:`CAP`."""
    tmp = tmp_path_factory.mktemp(request.param.replace(" ", "-"))
    procs = []
    try:
        if request.param == "policy endpoint":
            yield from _policy_endpoint(tmp)
            return
        store, store_url = _serve(tmp / "store.log", "store", "--db", tmp / "rollouts.sqlite")
        procs.append(store)
        if request.param == "store service":
            yield store_url, store.pid
            return
        gateway, gateway_url = _serve(tmp / "gateway.log", "gateway", "--store", store_url)
        procs.append(gateway)
        yield gateway_url, gateway.pid
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(timeout=60)


def _policy_endpoint(tmp):
    from agl_plugin_torch.backend import create
    from agl_plugin_torch.settings import TorchConfig
    from agl_plugin_torch.testing import tiny_section

    os.environ.pop("AGL_POLICY_TOKEN", None)
    backend = create(TorchConfig.model_validate(tiny_section(serving={"max_connections": CAP, "process": True})),
                     tmp, seed=0, with_critic=False)
    backend.start_serving("policy")
    try:
        yield backend.endpoint.url, backend.endpoint.process.pid
    finally:
        backend.stop_serving()


def address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname, parts.port


def rss(pid: int) -> int:
    """Resident bytes of the process ``pid`` and its children."""
    process = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)])


class Checker:
    """A second client that asks ``/healthz`` every 50 ms on a connection of its own, while the flood goes on."""

    def __init__(self, url: str):
        self.client = httpx.Client(base_url=url, timeout=5.0)
        self.answers, self.failures = 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                response = self.client.get("/healthz")
                if response.status_code == 200:
                    self.answers += 1
                else:
                    self.failures.append(response.status_code)
            except httpx.HTTPError as exc:
                self.failures.append(repr(exc))
            self._stop.wait(0.05)

    def __enter__(self) -> Checker:
        self.client.get("/healthz").raise_for_status()  # its connection is made before the flood
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
        self.client.close()

    def check(self, answers: int = 3) -> None:
        """No failure so far, and at least ``answers`` answers (waiting up to 10 s for them)."""
        deadline = time.monotonic() + 10
        while self.answers < answers and not self.failures and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not self.failures, f"the service failed the second client: {self.failures[:5]}"
        assert self.answers >= answers, f"the second client got {self.answers} answers during the flood"


def answer_of(sock: socket.socket, timeout_s: float) -> bytes:
    """What the server sent before closing (or within ``timeout_s``); b"" for a reset or nothing."""
    sock.settimeout(timeout_s)
    data = b""
    with contextlib.suppress(OSError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def push(sock: socket.socket, data: bytes, limit_bytes: int, seconds: float) -> tuple[int, bool]:
    """Send ``data`` over and over without reading, for ``seconds`` or ``limit_bytes``; (bytes sent, whether the
    server closed the connection or stopped reading: a send that did not go through within 2 s)."""
    sock.setblocking(False)
    sent, deadline = 0, time.monotonic() + seconds
    while sent < limit_bytes and time.monotonic() < deadline:
        _, writable, _ = select.select([], [sock], [], 2.0)
        if not writable:
            return sent, True  # the server no longer reads this connection
        try:
            sent += sock.send(data)
        except (BrokenPipeError, ConnectionResetError):
            return sent, True
    return sent, False


def test_a_client_pipelining_without_reading_stops_being_read_and_holds_bounded_memory(service):
    url, pid = service
    before = rss(pid)
    results, grown = [], 0
    with Checker(url) as checker:
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:  # 4 connections at a time; closed ones are made again
            flooders = [socket.create_connection(address(url)) for _ in range(4)]
            try:
                results += [push(sock, REQUEST * 1000, 64 * 2**20, 5.0) for sock in flooders]
                grown = max(grown, rss(pid) - before)
            finally:
                for sock in flooders:
                    sock.close()
        checker.check()
    for sent, stopped in results:
        assert stopped, f"the service read {sent} bytes of pipelined requests whose answers were never read"
        assert sent < 32 * 2**20
    assert grown < 200 * 2**20, f"4 pipelining clients grew the service by {grown / 2**20:.0f} MiB"


@pytest.mark.parametrize("where", ["header value", "header name", "request target"])
def test_an_endless_header_line_is_refused_before_it_is_buffered_whole(service, where):
    url, pid = service
    heads = {"header value": b"GET /healthz HTTP/1.1\r\nX-Endless: ", "header name": b"GET /healthz HTTP/1.1\r\nX-",
             "request target": b"GET /healthz?q="}
    sock = socket.create_connection(address(url))
    try:
        with Checker(url) as checker:
            sock.sendall(heads[where])
            sent, stopped = push(sock, b"a" * 65536, 256 * 2**20, 20.0)
            answer = answer_of(sock, 5.0)
            checker.check()
    finally:
        sock.close()
    assert stopped, f"the service read {sent} bytes of one header line"
    assert sent < 64 * 2**20
    # The server answers 431, then closes; a client still sending may see the close as a reset first.
    assert answer == b"" or answer.startswith(b"HTTP/1.1 431"), answer[:200]


def test_many_small_headers_past_the_limit_are_refused_with_431(service):
    url, _ = service
    headers = b"".join(b"X-H%d: v\r\n" % i for i in range(HEADER_LIMITS.max_header_bytes // 8))
    with socket.create_connection(address(url)) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
        assert answer_of(sock, 10.0).startswith(b"HTTP/1.1 431")
    assert httpx.get(url + "/healthz", headers={f"X-H{i}": "v" * 100 for i in range(40)}).status_code == 200


def test_slowloris_header_trickles_are_cut_at_the_header_timeout(service):
    url, _ = service
    trickles = [socket.create_connection(address(url)) for _ in range(8)]
    closed_at: dict[int, float] = {}
    answers = []
    start = time.monotonic()
    try:
        with Checker(url) as checker:
            for sock in trickles:
                sock.sendall(b"GET /healthz HTTP/1.1\r\n")
            line = 0
            while len(closed_at) < len(trickles) and time.monotonic() - start < HEADER_LIMITS.header_timeout_s + 10:
                for k, sock in enumerate(trickles):
                    if k in closed_at:
                        continue
                    with contextlib.suppress(OSError):
                        sock.sendall(b"X-%d: y\r\n" % line)
                    if select.select([sock], [], [], 0)[0]:  # answered or closed
                        answers.append(answer_of(sock, 1.0))
                        closed_at[k] = time.monotonic() - start
                line += 1
                time.sleep(0.5)
            checker.check()
    finally:
        for sock in trickles:
            sock.close()
    assert len(closed_at) == len(trickles), "a header trickle was still open well past the header timeout"
    assert min(closed_at.values()) >= HEADER_LIMITS.header_timeout_s - 1
    assert all(answer == b"" or answer.startswith(b"HTTP/1.1 408") for answer in answers), answers


def test_idle_connections_up_to_the_cap_leave_it_answering_and_one_more_is_refused_fast(service):
    url, _ = service
    idle = []
    try:
        with Checker(url) as checker:
            # The checker holds one connection; the cap is reached with CAP - 1 more.
            idle = [socket.create_connection(address(url)) for _ in range(CAP - 1)]
            time.sleep(0.5)
            over = [socket.create_connection(address(url)) for _ in range(5)]
            answers = [answer_of(sock, 5.0) for sock in over]
            for sock in over:
                sock.close()
            assert all(answer.startswith(b"HTTP/1.1 503") for answer in answers), [a[:60] for a in answers]
            checker.check()  # its kept-alive connection was made before the cap was reached
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.5)
    assert httpx.get(url + "/healthz").status_code == 200  # room again once they left
