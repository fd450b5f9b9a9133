"""Gateway overhead: agents call the test policy endpoint directly and through the gateway, in one run.

Three processes, as in a real run: the test endpoint, the gateway (memory
store, one running attempt per agent), and this one, whose agents are
coroutines posting chat completions with aiohttp. The direct calls ask the
endpoint for exactly what the gateway asks for (token ids and log-probs), so
the difference is the gateway's hop: parsing, checks, forwarding and writing
the span.

Two phases per path: one agent calling in sequence (latency: what the gateway
adds to a call) and ``--agents`` concurrent agents (throughput: calls/s with
the cores busy; latency there includes queueing). Prints one JSON line.
Targets (issue 4): at most 1 ms p50 added, at least 1,500 calls/s through the
gateway on 2 cores.

    python benchmarks/bench_gateway.py [--agents 32] [--calls 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import subprocess
import sys
import time

import aiohttp
import numpy as np

MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France? Answer in one word."}]


def serve_gateway(upstream: str, n_rollouts: int) -> None:
    """Child process: a gateway over a memory store with ``n_rollouts`` running attempts; prints its URL."""
    from agl_core.builtin.memory_store import MemoryStore
    from agl_core.data import Task
    from agl_core.gateway import Gateway
    from agl_core.store import NewRollout

    store = MemoryStore()
    store.enqueue([NewRollout(f"r{i}", Task(id="t", input={})) for i in range(n_rollouts)])
    for _ in range(n_rollouts):
        store.dequeue("bench", lease_s=3600)
    server = Gateway(store, sampling={"temperature": 1.0, "max_tokens": 64}, upstreams=[upstream]).serve()
    gc.collect()
    gc.freeze()  # as Trainer.fit does once the run is set up: full collections skip the long-lived objects
    print(server.url, flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    print(json.dumps({"spans": sum(len(e.spans) for e in store._entries.values())}), flush=True)
    server.stop()


async def call_loop(session: aiohttp.ClientSession, url: str, body: bytes, n: int, latencies: list[float]) -> None:
    for _ in range(n):
        start = time.perf_counter()
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as response:
            payload = await response.read()
            if response.status != 200:
                raise RuntimeError(f"{url} answered {response.status}: {payload[:200]!r}")
        latencies.append(time.perf_counter() - start)


async def phase(urls: list[str], body: bytes, calls: int) -> dict[str, float]:
    """``len(urls)`` agents (one URL each) make ``calls`` calls in all; latency percentiles and calls/s."""
    latencies: list[float] = []
    per_agent = calls // len(urls)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(call_loop(session, url, body, 5, []) for url in urls))  # warm connections
        start = time.perf_counter()
        await asyncio.gather(*(call_loop(session, url, body, per_agent, latencies) for url in urls))
        elapsed = time.perf_counter() - start
    p50, p99 = np.percentile(latencies, [50, 99]) * 1000
    return {"p50_ms": round(float(p50), 3), "p99_ms": round(float(p99), 3),
            "calls_per_s": round(len(latencies) / elapsed, 1)}


def start(args: list[str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=32, help="concurrent agents of the throughput phase")
    parser.add_argument("--calls", type=int, default=3000, help="calls per phase and path")
    parser.add_argument("--serve-gateway", nargs=2, metavar=("UPSTREAM", "N_ROLLOUTS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_gateway:
        serve_gateway(args.serve_gateway[0], int(args.serve_gateway[1]))
        return

    endpoint, endpoint_url = start(["-m", "agl_core.testing_endpoint"])
    gateway, gateway_url = start([__file__, "--serve-gateway", endpoint_url + "/v1", str(args.agents)])
    try:
        agent_body = {"model": "policy", "messages": MESSAGES}
        # What the gateway sends upstream for that call: the direct path asks for the same work.
        direct_body = {**agent_body, "return_token_ids": True, "logprobs": True, "temperature": 1.0, "max_tokens": 64}
        direct = [f"{endpoint_url}/v1/chat/completions"] * args.agents
        through = [f"{gateway_url}/rollout/r{i}/attempt/1/v1/chat/completions" for i in range(args.agents)]
        calls = args.calls - args.calls % args.agents
        encode = json.dumps
        results = {
            "direct_1": asyncio.run(phase(direct[:1], encode(direct_body).encode(), calls // 4)),
            "gateway_1": asyncio.run(phase(through[:1], encode(agent_body).encode(), calls // 4)),
            f"direct_{args.agents}": asyncio.run(phase(direct, encode(direct_body).encode(), calls)),
            f"gateway_{args.agents}": asyncio.run(phase(through, encode(agent_body).encode(), calls)),
        }
        gateway.stdin.close()
        spans = json.loads(gateway.stdout.readline())["spans"]
    finally:
        gateway.kill()
        endpoint.kill()
    many = args.agents
    line = {
        "bench": "gateway",
        "agents": many,
        "direct": {"sequential": results["direct_1"], "concurrent": results[f"direct_{many}"]},
        "gateway": {"sequential": results["gateway_1"], "concurrent": results[f"gateway_{many}"]},
        "added_p50_ms": round(results["gateway_1"]["p50_ms"] - results["direct_1"]["p50_ms"], 3),
        "gateway_calls_per_s": results[f"gateway_{many}"]["calls_per_s"],
        "throughput_ratio_gateway_vs_direct": round(
            results[f"gateway_{many}"]["calls_per_s"] / results[f"direct_{many}"]["calls_per_s"], 3),
        "spans_recorded": spans,
        "targets": {"added_p50_ms_max": 1.0, "gateway_calls_per_s_min": 1500},
    }
    print(json.dumps(line))


if __name__ == "__main__":
    main()
