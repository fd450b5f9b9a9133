"""The HTTP parts side by side: servers for the project's services, the gateway's upstream client, the store's.

On a trivial ASGI app (a ~200-byte JSON POST answered with ~100 bytes), one
kept-alive client posting sequentially, p50 of the round trip:

- servers (each in a process of its own, the client an aiohttp session in
  this one): uvicorn on httptools with the project's limits
  (:class:`agl_core.http.server.ServerThread`, the reference), uvicorn on
  httptools as shipped, uvicorn on h11, and hypercorn and granian when they
  are installed (they are not dependencies: ``pip install hypercorn granian``
  to include them);
- clients (against the reference server): aiohttp and httpx;
- synchronous clients against ``agl serve store`` (its own process), each
  posting ``attempt_state`` of a rollout the store does not hold (a ~50-byte
  JSON POST answered with ``{"state": null}``) on one kept-alive connection:
  :class:`~agl_core.rollout.store_client.HttpStore` as shipped (its call, JSON in and
  out included), then the bare round trip of ``http.client`` (the
  reference), urllib3's ``HTTPConnectionPool`` and ``httpx.Client``.

Prints one JSON line: each p50 in µs and its ratio to the reference.

    python benchmarks/bench_http_parts.py [--calls 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp
import httpx
import urllib3

from agl_core.rollout.store_client import HttpStore

BODY = json.dumps({"model": "policy", "messages": [{"role": "user", "content": "x" * 150}]}).encode()
ANSWER = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "y" * 40}}]}).encode()


async def app(scope, receive, send):
    """The trivial app: reads the body, answers ANSWER."""
    if scope["type"] == "lifespan":
        while (message := await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": ANSWER})


def serve(kind: str) -> None:
    """Serve :func:`app` with ``kind`` on a free port of 127.0.0.1, on this process's main thread; print the URL
    first (the caller waits until it accepts connections) and serve until killed."""
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    print(f"http://127.0.0.1:{port}", flush=True)
    if kind == "agl (uvicorn-httptools, limits)":
        from agl_core.http.server import ServerThread
        sock.close()
        ServerThread(app, port=port).start()
        threading.Event().wait()
    elif kind.startswith("uvicorn"):
        import uvicorn
        uvicorn.Server(uvicorn.Config(app, loop="uvloop", http="h11" if "h11" in kind else "httptools",
                                      log_level="warning", access_log=False)).run(sockets=[sock])
    elif kind == "hypercorn":
        import hypercorn.asyncio
        import hypercorn.config
        config = hypercorn.config.Config()
        config.bind, config.loglevel = [f"127.0.0.1:{port}"], "warning"
        sock.close()
        asyncio.run(hypercorn.asyncio.serve(app, config))
    elif kind == "granian":
        from granian import Granian
        sock.close()
        Granian("bench_http_parts:app", address="127.0.0.1", port=port, interface="asgi", workers=1,
                log_enabled=False).serve()


def wait_for(url: str) -> None:
    host, port = url.removeprefix("http://").split(":")
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


async def with_aiohttp(url: str, calls: int) -> list[float]:
    times = []
    async with aiohttp.ClientSession() as session:
        for _ in range(calls):
            start = time.perf_counter()
            async with session.post(url, data=BODY, headers={"Content-Type": "application/json"}) as response:
                await response.read()
            times.append(time.perf_counter() - start)
    return times


async def with_httpx(url: str, calls: int) -> list[float]:
    times = []
    async with httpx.AsyncClient() as client:
        for _ in range(calls):
            start = time.perf_counter()
            response = await client.post(url, content=BODY, headers={"Content-Type": "application/json"})
            response.read()
            times.append(time.perf_counter() - start)
    return times


def p50_us(client, url: str, calls: int) -> float:
    asyncio.run(client(url, calls // 10))  # warm-up
    return round(statistics.median(asyncio.run(client(url, calls))) * 1e6, 1)


STORE_BODY = json.dumps({"rollout_id": "absent", "attempt_id": "absent"}).encode()
STORE_PATH = "/v1/store/attempt_state"
STORE_HEADERS = {"Content-Type": "application/json"}


def sync_p50_us(post, calls: int) -> float:
    """p50 of ``post()`` (one round trip; it checks its answer) over ``calls`` calls, after a tenth as warm-up."""
    for _ in range(calls // 10):
        post()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        post()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e6, 1)


def checked(status: int, body: bytes) -> None:
    if status != 200 or json.loads(body) != {"state": None}:
        raise SystemExit(f"the store service answered HTTP {status}: {body[:200]!r}")


def store_clients(url: str, calls: int) -> dict[str, float]:
    """The synchronous clients against the store service at ``url``, p50 in µs."""
    host, port = url.removeprefix("http://").split(":")
    store = HttpStore(url)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    pool = urllib3.HTTPConnectionPool(host, int(port), maxsize=1, retries=False, timeout=60)
    client = httpx.Client(base_url=url, timeout=60)

    def with_http_client() -> None:
        conn.request("POST", STORE_PATH, STORE_BODY, STORE_HEADERS)
        response = conn.getresponse()
        checked(response.status, response.read())

    def with_urllib3() -> None:
        response = pool.urlopen("POST", STORE_PATH, body=STORE_BODY, headers=STORE_HEADERS)
        checked(response.status, response.data)

    def with_httpx() -> None:
        response = client.post(STORE_PATH, content=STORE_BODY, headers=STORE_HEADERS)
        checked(response.status_code, response.content)

    def with_http_store() -> None:
        if store.attempt_state("absent", "absent") is not None:
            raise SystemExit("the store service holds a rollout it should not")

    try:
        return {"HttpStore (agl_core)": sync_p50_us(with_http_store, calls),
                "http.client": sync_p50_us(with_http_client, calls),
                "urllib3": sync_p50_us(with_urllib3, calls), "httpx.Client": sync_p50_us(with_httpx, calls)}
    finally:
        store.close()
        conn.close()
        pool.close()
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return
    import uvloop
    uvloop.install()
    kinds = ["agl (uvicorn-httptools, limits)", "uvicorn-httptools", "uvicorn-h11"]
    kinds += [kind for kind in ("hypercorn", "granian") if importlib.util.find_spec(kind)]
    servers, clients = {}, {}
    for kind in kinds:
        proc = subprocess.Popen([sys.executable, __file__, "--serve", kind], stdout=subprocess.PIPE, text=True,
                                cwd=Path(__file__).parent, start_new_session=True)  # a group: granian forks
        try:
            url = proc.stdout.readline().strip()
            wait_for(url)
            servers[kind] = p50_us(with_aiohttp, url, args.calls)
            if kind == kinds[0]:
                clients = {"aiohttp": servers[kind], "httpx": p50_us(with_httpx, url, args.calls)}
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with tempfile.TemporaryDirectory(prefix="bench_http_parts_") as tmp:
        proc = subprocess.Popen([sys.executable, "-m", "agl_core.cli", "serve", "store", "--db",
                                 str(Path(tmp) / "store.sqlite"), "--port", "0"], stdout=subprocess.PIPE, text=True)
        try:
            sync_clients = store_clients(proc.stdout.readline().strip(), args.calls)
        finally:
            proc.kill()
            proc.wait()
    reference = servers[kinds[0]]
    print(json.dumps({"bench": "http_parts", "calls": args.calls,
                      "server_p50_us": servers, "server_ratio_to_agl": {k: round(v / reference, 3)
                                                                        for k, v in servers.items()},
                      "client_p50_us": clients, "client_ratio_to_aiohttp": {k: round(v / clients["aiohttp"], 3)
                                                                            for k, v in clients.items()},
                      "store_client_p50_us": sync_clients,
                      "store_client_ratio_to_http_client": {k: round(v / sync_clients["http.client"], 3)
                                                            for k, v in sync_clients.items()}}))


if __name__ == "__main__":
    main()
