"""Store throughput: spans/s written and read back, memory store vs sqlite store (a real file), in one run.

Spans are model calls of a realistic size (256 prompt ids, 64 response ids
with log-probs, a request and a response in the attributes), spread over
rollouts of 50 calls. They are written the way the gateway writes them, one
``add_spans`` call per span, and made durable with ``flush``; the sqlite
store batches them into transactions itself. Reading back is
``get_rollouts`` of every rollout. Prints one JSON line. Target (issue 4):
at least 20,000 spans/s into sqlite.

    python benchmarks/bench_store.py [--spans 40000]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from agl_plugin_sqlite import SqliteStore

from agl_core.builtin.memory_store import MemoryStore
from agl_core.data import Span, Task
from agl_core.rollout.store import NewRollout

CALLS_PER_ROLLOUT = 50


def make_spans(n: int) -> list[Span]:
    request = {"model": "policy", "messages": [{"role": "user", "content": "What is 2 + 2? " * 8}]}
    response = {"id": "cmpl-1", "object": "chat.completion", "model": "policy",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "4 " * 32},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 256, "completion_tokens": 64, "total_tokens": 320}}
    return [Span(rollout_id=f"r{i // CALLS_PER_ROLLOUT}", attempt_id="1", sequence_id=i % CALLS_PER_ROLLOUT,
                 kind="llm_call", prompt_token_ids=list(range(1000, 1256)),
                 response_token_ids=list(range(2000, 2064)), response_logprobs=[-0.5] * 64,
                 attributes={"request": request, "response": response, "upstream": "http://127.0.0.1:8000/v1"},
                 start_time=0.0, end_time=1.0)
            for i in range(n)]


def measure(store, spans: list[Span]) -> dict[str, float]:
    rollout_ids = list(dict.fromkeys(span.rollout_id for span in spans))
    store.enqueue([NewRollout(rid, Task(id=rid, input={})) for rid in rollout_ids])
    leases = {(a.rollout_id, a.attempt_id): a.lease for a in (store.dequeue("bench", lease_s=3600)
                                                              for _ in rollout_ids)}
    start = time.perf_counter()
    for span in spans:
        store.add_spans([span], leases=leases)
    store.flush()
    write_s = time.perf_counter() - start
    for rid in rollout_ids:
        store.finish(rid, "1", "succeeded", final_reward=1.0, lease=leases[rid, "1"])
    start = time.perf_counter()
    rollouts = store.get_rollouts(rollout_ids)
    read_s = time.perf_counter() - start
    read = sum(len(r.spans) for r in rollouts)
    if read != len(spans):
        raise RuntimeError(f"wrote {len(spans)} spans, read back {read}")
    return {"write_spans_per_s": round(len(spans) / write_s), "read_spans_per_s": round(read / read_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=40_000)
    args = parser.parse_args()
    spans = make_spans(args.spans)
    memory = MemoryStore()
    mem = measure(memory, spans)
    memory.close()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rollouts.sqlite"
        store = SqliteStore(path)
        sql = measure(store, spans)
        store.close()
        size_mb = path.stat().st_size / 2**20
    print(json.dumps({
        "bench": "store",
        "spans": args.spans,
        "memory": mem,
        "sqlite": {**sql, "file_mb": round(size_mb, 1)},
        "write_ratio_sqlite_vs_memory": round(sql["write_spans_per_s"] / mem["write_spans_per_s"], 3),
        "read_ratio_sqlite_vs_memory": round(sql["read_spans_per_s"] / mem["read_spans_per_s"], 3),
        "target": {"sqlite_write_spans_per_s_min": 20_000},
    }))


if __name__ == "__main__":
    main()
