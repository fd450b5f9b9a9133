"""Runners side by side: the local runner's threads vs Ray runner actors, and the HTTP store vs the in-process one.

1. Throughput of a CPU-bound agent: each rollout plays 4 turns, each a chat
   call through the real ``openai`` client to the test policy endpoint (its own
   process) behind the gateway, then about 5 ms of pure-Python work. The
   ``local_runner`` plugin runs it on 16 threads (``--workers``) of this
   process (its gateway and SQLite store in this process too); the ``ray``
   plugin on 2 actor processes of 8 workers each (a local Ray; the store and
   gateway as services). Fewer workers leave the actors waiting on the extra
   hops (at 4 per actor each used under half a core), while more threads only
   lengthen the GIL's queue. Both are set up once, then their steps
   alternate; rollouts/s is the median over the rounds. Goal: Ray at least
   1.5x the threads. The CPU time each role (trainer, actors, store and
   gateway services, endpoint, Ray's own processes) used per rollout says
   where the cores went: on a busy machine the rates move, those figures
   much less.
2. The store service's added latency per rollout: enqueue, dequeue, the spans
   of 4 calls admitted and written as the gateway does, finish and read back
   (the issue's stages), through :class:`~agl_core.rollout.store_client.HttpStore`
   against ``agl serve store`` (a client for each role: trainer, runner,
   gateway) vs :class:`~agl_plugin_sqlite.SqliteStore` in this process
   (shared by the roles), alternating blocks. Goal: at most 3 ms more at
   p50 (issue 37: the service on uvicorn, not on hand-written protocol code). Each rollout is then released, timed apart (``release`` and
   ``p50_with_release_ms``): the issue does not count it, and the trainer
   releases a step's rollouts in one call.
3. With ``--recipes`` (long: two trainings of ``--steps`` steps): the default
   game with ``recipe.yaml`` and ``recipe_ray.yaml``, seconds per step and the
   validation rewards. Goal: no slower per step, the same learning.

Prints one JSON line.

    python benchmarks/bench_runners.py [--rollouts 96] [--rounds 3] [--workers 16] [--store-rollouts 400] [--recipes]
    python benchmarks/bench_runners.py --store-only   # phase 2 alone
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import agl_plugin_ray.plugin as ray_plugin
import numpy as np
import psutil  # a dependency of ray
from agl_plugin_ray import services
from agl_plugin_sqlite import SqliteStore
from bench_learning import read_records
from openai import DefaultHttpxClient, OpenAI

from agl_core.builtin import local_runner
from agl_core.config import load
from agl_core.data import Span, Task
from agl_core.loop import Trainer
from agl_core.rollout.store import NewRollout, Store
from agl_core.rollout.store_client import HttpStore
from agl_core.testing import PolicyEndpoints

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
TURNS = 4
WORK_MS = 5.0
ACTORS = 2
AGENT = "bench_runners:cpu_agent"
"""Imported from this directory: on sys.path when run as a script, and in the actors through their runtime_env."""

HTTP = DefaultHttpxClient()  # one connection pool per process, as examples/guess_number/agent.py keeps


def busy(iters: int) -> int:
    """Pure-Python work that holds the GIL."""
    total = 0
    for i in range(iters):
        total += i * i
    return total


def cpu_agent(task, llm) -> float:
    """4 turns of a chat call then ``task.input["iters"]`` loops of work (about 5 ms); reward 1."""
    client = OpenAI(base_url=llm.base_url, api_key=llm.api_key, http_client=HTTP, max_retries=0)
    for turn in range(TURNS):
        client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": f"turn {turn}"}])
        busy(task.input["iters"])
    return 1.0


def calibrate(ms: float) -> int:
    """Loops of :func:`busy` that take about ``ms`` milliseconds here (the best of several tries)."""
    probe = 200_000
    best = min(_timed(busy, probe) for _ in range(5))
    return max(1, int(probe * ms / 1000 / best))


def _timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


# ---------------------------------------------------------------- 1. throughput


def context(run_dir: Path, endpoint_url: str, runner: list[str], flags: list[str], tasks):
    """The TrainContext of a run whose collect_rollouts is ``runner``'s, on the instant backend."""
    overrides = [f"trainer.run_dir={run_dir}", "trainer.progress=false", f"rollout.agent={AGENT}", "rollout.n=1",
                 f"data.train_batch_size={len(tasks)}", "rollout.store=sqlite", "trainer.val_before_train=false",
                 "plugins.slots.policy_endpoints=endpoints", *runner]
    recipe, plugins = load(None, overrides, ["instant", *flags],
                           extra_plugins=[("endpoints", PolicyEndpoints([endpoint_url]))])
    run_dir.mkdir(parents=True)
    return Trainer(recipe, plugins, train_tasks=tasks, val_tasks=[]).ctx


PROCESS_ROLES = (("serve store", "store_service"), ("serve gateway", "gateway_service"), ("testing_endpoint", "endpoint"),
         ("RunnerActor", "ray_actors"))
"""Which process is which, by a piece of its command line; this process is the trainer, any other one Ray's own."""


def cpu_seconds() -> dict[str, float]:
    """CPU time (user + system) used so far by this process and each of its descendants, summed by role."""
    me = psutil.Process()
    totals: dict[str, float] = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            times, command = proc.cpu_times(), " ".join(proc.cmdline())
        except psutil.Error:  # ended meanwhile
            continue
        role = "trainer" if proc.pid == me.pid else next((r for key, r in PROCESS_ROLES if key in command), "ray_system")
        totals[role] = totals.get(role, 0.0) + times.user + times.system
    return totals


def throughput(endpoint_url: str, tmp: Path, n_rollouts: int, rounds: int, iters: int, workers: int) -> dict:
    """Rollouts/s of each runner with ``workers`` agent workers in all, its steps alternating with the other's.

    Also the CPU each role used per rollout during each runner's rounds (ms): where the cores went.
    """
    tasks = [Task(id=f"t{i}", input={"iters": iters}) for i in range(n_rollouts)]
    sides = {
        "threads": (local_runner, context(tmp / "threads", endpoint_url,
                                          ["plugins.slots.collect_rollouts=local_runner",
                                           f"rollout.n_workers={workers}"], ["sqlite"], tasks)),
        "ray": (ray_plugin, context(tmp / "ray", endpoint_url,
                                    ["plugins.slots.collect_rollouts=ray", f"plugins.ray.actors={ACTORS}",
                                     f"plugins.ray.workers={workers // ACTORS}",
                                     f"plugins.ray.runtime_env.env_vars.PYTHONPATH={HERE}"], ["ray"], tasks)),
    }
    rates: dict[str, list[float]] = {name: [] for name in sides}
    cpu: dict[str, dict[str, float]] = {name: {} for name in sides}
    with contextlib.ExitStack() as stack:
        for plugin, ctx in sides.values():
            plugin.on_train_start(ctx)
            stack.callback(plugin.on_train_end, ctx)
        for round_ in range(rounds + 1):  # round 0 warms connections and imports up
            for name, (plugin, ctx) in sides.items():
                ctx.step = round_ + 1
                before, start = cpu_seconds(), time.perf_counter()
                rollouts = plugin.collect_rollouts(ctx, tasks, "train")
                elapsed, after = time.perf_counter() - start, cpu_seconds()
                if sum(r.status == "succeeded" for r in rollouts) != n_rollouts:
                    raise SystemExit(f"{name}: not every rollout succeeded: {[r.error for r in rollouts][:3]}")
                if round_:
                    rates[name].append(n_rollouts / elapsed)
                    for role, used in after.items():
                        cpu[name][role] = cpu[name].get(role, 0.0) + used - before.get(role, 0.0)
    threads, ray_ = statistics.median(rates["threads"]), statistics.median(rates["ray"])
    per_rollout = {name: {role: round(used * 1000 / (n_rollouts * rounds), 2) for role, used in sorted(roles.items())
                          if used > 0} for name, roles in cpu.items()}
    return {"rollouts_per_round": n_rollouts, "rounds": rounds, "workers": workers, "actors": ACTORS,
            "work_ms_per_turn": WORK_MS, "turns": TURNS,
            "threads_rollouts_per_s": round(threads, 1), "ray_rollouts_per_s": round(ray_, 1),
            "ray_vs_threads": round(ray_ / threads, 3),
            "per_round": {name: [round(r, 1) for r in values] for name, values in rates.items()},
            "cpu_ms_per_rollout": {name: {**roles, "all": round(sum(roles.values()), 2)}
                                   for name, roles in per_rollout.items()}}


# ---------------------------------------------------------------- 2. store latency


STORE_OPS = ("enqueue", "dequeue", "spans", "finish", "read_back")
"""The stages of a rollout's life the latency goal counts; ``release`` follows them, timed apart."""
STORE_ROLES = ("trainer", "runner", "gateway")


def one_rollout(roles: dict[str, Store], rollout_id: str, spans: list[Span]) -> dict[str, float]:
    """Seconds of each stage of a rollout's whole life (:data:`STORE_OPS`, then ``release``), each step by the role
    that takes it.

    ``roles`` maps ``trainer``, ``runner`` and ``gateway`` to their store: one
    object shared in one process, or a client each, as their three processes
    have when the store is a service.
    """
    trainer, runner, gateway = roles["trainer"], roles["runner"], roles["gateway"]
    times, clock = {}, time.perf_counter()

    def lap(op: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        times[op], clock = now - clock, now

    trainer.enqueue([NewRollout(rollout_id, Task(id="t", input={}))])
    lap("enqueue")
    attempt = runner.dequeue("bench", lease_s=60)
    lap("dequeue")
    for span in spans:  # as the gateway does: each call admitted (state and sequence id), then its span added
        _, [sequence_id] = gateway.admit(rollout_id, attempt.attempt_id, 1, lease=attempt.lease)
        gateway.add_spans([span.model_copy(update={"rollout_id": rollout_id, "attempt_id": attempt.attempt_id,
                                                   "sequence_id": sequence_id})],
                          leases={(rollout_id, attempt.attempt_id): attempt.lease})
    lap("spans")
    runner.finish(rollout_id, attempt.attempt_id, "succeeded", final_reward=1.0, lease=attempt.lease)
    lap("finish")
    [rollout] = trainer.get_rollouts([rollout_id])
    lap("read_back")
    trainer.release([rollout_id])
    lap("release")
    if len(rollout.spans) != len(spans):
        raise SystemExit(f"{type(trainer).__name__} read back {len(rollout.spans)} spans of {len(spans)}")
    return times


def store_latency(tmp: Path, n: int, block: int = 50) -> dict:
    """ms per rollout in each store (p50, p90, and the p50 of each stage), blocks of ``block`` rollouts alternating.

    In process, trainer, runner and gateway share one SQLite store (the local
    runner's setting); against the service each role has its own client.
    """
    spans = [Span(rollout_id="r", sequence_id=0, kind="llm_call", prompt_token_ids=list(range(64)),
                  response_token_ids=list(range(100, 116)), response_logprobs=[-0.5] * 16,
                  attributes={"request": {"messages": [{"role": "user", "content": "turn"}]}})] * TURNS
    service = services.start("store", ["store", "--db", str(tmp / "served.sqlite")], tmp / "store.log", {}, 60.0)
    local = SqliteStore(tmp / "local.sqlite")
    setups = {"sqlite_in_process": dict.fromkeys(STORE_ROLES, local),
              "http_service": {role: HttpStore(service.url) for role in STORE_ROLES}}
    laps: dict[str, list[dict[str, float]]] = {name: [] for name in setups}
    try:
        for name, roles in setups.items():  # warm-up: connections, statements
            for i in range(20):
                one_rollout(roles, f"warm-{name}-{i}", spans)
        for start in range(0, n, block):
            for name, roles in setups.items():
                laps[name] += [one_rollout(roles, f"{name}-{i}", spans) for i in range(start, min(n, start + block))]
    finally:
        for roles in setups.values():
            for store in set(roles.values()):
                store.close()
        service.stop()
    figures = {}
    for name, runs in laps.items():
        p50, p90 = np.percentile([sum(r[op] for op in STORE_OPS) for r in runs], [50, 90]) * 1000
        figures[name] = {"p50_ms": round(float(p50), 3), "p90_ms": round(float(p90), 3),
                         "p50_with_release_ms": round(float(np.median([sum(r.values()) for r in runs])) * 1000, 3),
                         "stage_p50_ms": {op: round(float(np.median([r[op] for r in runs])) * 1000, 3)
                                          for op in (*STORE_OPS, "release")}}
    added = {key: round(figures["http_service"][key] - figures["sqlite_in_process"][key], 3)
             for key in ("p50_ms", "p50_with_release_ms")}
    return {"rollouts": n, "spans_per_rollout": TURNS, **figures, "added_p50_ms": added["p50_ms"],
            "added_p50_with_release_ms": added["p50_with_release_ms"]}


# ---------------------------------------------------------------- 3. the recipes


def train(recipe: Path, run_dir: Path, steps: int) -> dict:
    """``agl train recipe`` for ``steps`` steps on seed 0: seconds per step and the validation rewards by step."""
    command = [sys.executable, "-m", "agl_core.cli", "train", str(recipe), f"trainer.run_dir={run_dir}",
               f"trainer.total_steps={steps}", "trainer.seed=0", "trainer.progress=false", "trainer.save_freq=0"]
    log = run_dir.parent / f"{run_dir.name}.log"
    with open(log, "w") as out:
        if subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
            raise SystemExit(f"{recipe.name} failed; see {log}")
    records = read_records(run_dir / "metrics.jsonl")
    steps_timed = [r["timing_s/step"] for r in records if r["step"] > 0 and "timing_s/step" in r]
    val = {r["step"]: r["val/reward/mean"] for r in records if r.get("val/reward/mean") is not None}
    return {"s_per_step": round(statistics.mean(steps_timed), 3), "val_reward_by_step": val,
            "first_step_at_1.0": min((s for s, v in val.items() if v >= 1.0), default=None)}


def recipes(tmp: Path, steps: int) -> dict:
    example = ROOT / "examples" / "guess_number"
    return {name: train(example / f"{name}.yaml", tmp / name, steps) for name in ("recipe", "recipe_ray")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=96, help="rollouts per step and runner")
    parser.add_argument("--rounds", type=int, default=3, help="measured steps per runner (after one warm-up)")
    parser.add_argument("--workers", type=int, default=16,
                        help=f"agent workers in all: threads of the local runner, split over the {ACTORS} actors")
    parser.add_argument("--store-rollouts", type=int, default=400, help="rollouts per store")
    parser.add_argument("--recipes", action="store_true", help="also train the default game on both recipes (long)")
    parser.add_argument("--steps", type=int, default=40, help="steps of each training with --recipes")
    parser.add_argument("--store-only", action="store_true", help="measure the store service's latency alone")
    args = parser.parse_args()
    endpoint = subprocess.Popen([sys.executable, "-m", "agl_core.testing.endpoint", "--port", "0"],
                                stdout=subprocess.PIPE, text=True)
    try:
        endpoint_url = endpoint.stdout.readline().strip() + "/v1"
        with tempfile.TemporaryDirectory(prefix="bench_runners_") as tmp:
            tmp = Path(tmp)
            # The latency phase first: the Ray cluster of the throughput phase takes a while to wind down, and
            # its processes' work would land in a figure of fractions of a millisecond.
            latency = store_latency(tmp, args.store_rollouts)
            line = {"bench": "runners", "store_latency": latency}
            if not args.store_only:
                line["throughput"] = throughput(endpoint_url, tmp / "throughput", args.rollouts, args.rounds,
                                                calibrate(WORK_MS), args.workers)
            if args.recipes:
                line["recipes"] = recipes(tmp, args.steps)
    finally:
        endpoint.kill()
    line["targets"] = {"ray_vs_threads_min": 1.5, "store_added_p50_ms_max": 3.0}
    print(json.dumps(line))


if __name__ == "__main__":
    main()
