"""The generation engine: requests from many threads, generated in batches by one worker thread.

Concurrent agents send their model calls at about the same time; the
engine's worker takes every request waiting in its queue (waiting briefly for
more after each arrival) and generates them as one batch, so N agents cost
one forward pass per token instead of N. A batch that fails is generated
again request by request, so a request that still fails fails alone. The
worker holds the model lock while it generates, and the trainer holds it
while it computes or updates: a response is always made by one version of
the weights, the one it reports.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from agl_plugin_torch.policies import BASE, adapters_per_row
from agl_plugin_torch.sampling import DYNAMIC, Sample, SamplingParams, generate

log = logging.getLogger("agl_plugin_torch")

IDLE_POLL_S = 0.1
"""How often an idle worker checks whether it should stop."""


@dataclass
class Generated:
    """The samples of one request and the weight version that produced them."""

    samples: list[Sample]
    weight_version: int


TokenCallback = Callable[[int, Sample], None]
"""Called from the engine's thread with a row of a request and its sample, each time the row gets a token."""


@dataclass
class _Job:
    prompts: Sequence[Sequence[int]]
    params: Sequence[SamplingParams]
    on_token: TokenCallback | None = None
    adapter: str | None = None  # the adapter of the request's policy (several policies), else None
    streamed: bool = False  # a token of it went out: it cannot be generated again
    future: Future = field(default_factory=Future)


class Engine:
    """Batches generation requests over ``model`` (shared with the trainer, guarded by ``lock``).

    ``weight_version()`` tells the version of the weights; it is read under
    the lock together with the weights. ``generator`` draws the samples of
    unseeded requests.
    """

    def __init__(self, model: torch.nn.Module, lock: threading.Lock, weight_version: Callable[[], int], *,
                 eos_token_ids: Sequence[int], pad_token_id: int, decode: Callable[[list[int]], str],
                 generator: torch.Generator, max_batch_rows: int = 256, batch_wait_s: float = 0.002,
                 kv_cache: str = DYNAMIC, compile_decode: bool = False):
        self.model, self.lock, self.weight_version, self.generator = model, lock, weight_version, generator
        self.kv_cache = kv_cache
        # CUDA graphs of the decode step: torch.compile records one per batch shape on first use.
        self.decode_forward = torch.compile(model.forward, mode="reduce-overhead") if compile_decode else None
        self.eos_token_ids, self.pad_token_id, self.decode = list(eos_token_ids), pad_token_id, decode
        self.max_batch_rows, self.batch_wait_s = max_batch_rows, batch_wait_s
        self.batches = 0  # generated batches
        # CPU time the worker spent generating: the model's share of a step's rollouts. (Its wall time
        # would also count the waits for the GIL, which the agents, the gateway and the servers hold.)
        self.busy_cpu_s = 0.0
        # What a GPU's throughput is read from: the tokens generated and the wall time the batches took.
        self.generated_tokens = 0
        self.busy_wall_s = 0.0
        self._queue: queue.Queue[_Job] = queue.Queue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._work, name="agl-torch-engine", daemon=True)

    def start(self) -> Engine:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the worker; requests still queued fail with RuntimeError."""
        self._stopping.set()
        self._thread.join(timeout_s)
        while not self._queue.empty():
            job = self._queue.get_nowait()
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(RuntimeError("the policy engine stopped"))

    def submit(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
               on_token: TokenCallback | None = None, adapter: str | None = None) -> Future:
        """Queue the generation of ``prompts`` (one params each); the future resolves to :class:`Generated`.

        Cancelling the future before the worker takes the request drops it.
        ``on_token(row, sample)`` is called, from the engine's thread, each
        time a row of this request gets a token (streaming), before the future
        resolves; a streamed request whose batch fails fails with it (its
        tokens went out: it is not generated again alone). ``adapter`` names
        the adapter of the request's policy when the model serves several
        (:mod:`agl_plugin_torch.policies`): requests of different adapters are
        generated in the same batch, each row through its own.
        """
        if self._stopping.is_set():
            raise RuntimeError("the policy engine stopped")
        job = _Job(prompts, params, on_token, adapter)
        self._queue.put(job)
        return job.future

    def _work(self) -> None:
        while not self._stopping.is_set():
            try:
                jobs = [self._queue.get(timeout=IDLE_POLL_S)]
            except queue.Empty:
                continue
            self._gather_more(jobs)
            # A request whose caller gave up (an HTTP client gone) is not generated; the others are now running
            # and can no longer be cancelled, so their results can always be set.
            jobs = [job for job in jobs if job.future.set_running_or_notify_cancel()]
            if not jobs:
                continue
            try:
                self._run(jobs)
            except Exception as exc:
                if len(jobs) == 1:
                    self._fail(jobs[0], exc)
                    continue
                # One request's failure must not fail the others batched with it: each runs again alone.
                log.exception("generation of a batch of %d requests failed; running each alone", len(jobs))
                for job in jobs:
                    if job.streamed:
                        self._fail(job, exc)
                        continue
                    try:
                        self._run([job])
                    except Exception as error:
                        self._fail(job, error)

    @staticmethod
    def _fail(job: _Job, exc: Exception) -> None:
        """Fail ``job`` with ``exc``; the engine keeps serving."""
        log.error("generation of a request failed", exc_info=exc)
        job.future.set_exception(exc)

    def _gather_more(self, jobs: list[_Job]) -> None:
        """Add requests arriving within ``batch_wait_s`` of the previous one, up to ``max_batch_rows``."""
        rows = len(jobs[0].prompts)
        while rows < self.max_batch_rows:
            try:
                job = self._queue.get(timeout=self.batch_wait_s) if self.batch_wait_s else self._queue.get_nowait()
            except queue.Empty:
                return
            jobs.append(job)
            rows += len(job.prompts)

    def _run(self, jobs: list[_Job]) -> None:
        prompts = [p for job in jobs for p in job.prompts]
        params = [p for job in jobs for p in job.params]
        routed = any(job.adapter is not None for job in jobs)
        adapters = [job.adapter or BASE for job in jobs for _ in job.prompts] if routed else None
        with self.lock, adapters_per_row(self.model, adapters):
            start, wall_start = time.thread_time(), time.perf_counter()
            version = self.weight_version()
            samples = generate(self.model, prompts, params, eos_token_ids=self.eos_token_ids,
                               pad_token_id=self.pad_token_id, decode=self.decode, generator=self.generator,
                               on_step=_streamer(jobs), kv_cache=self.kv_cache,
                               decode_forward=self.decode_forward)
            self.batches += 1
            self.busy_cpu_s += time.thread_time() - start
            self.busy_wall_s += time.perf_counter() - wall_start
            self.generated_tokens += sum(len(sample.token_ids) for sample in samples)
        start = 0
        for job in jobs:
            job.future.set_result(Generated(samples[start:start + len(job.prompts)], version))
            start += len(job.prompts)



def _streamer(jobs: list[_Job]) -> Callable[[list[Sample], list[int]], None] | None:
    """The ``on_step`` of a batch: each row that got a token, passed to its request's ``on_token``."""
    owners: dict[int, tuple[_Job, int]] = {}
    start = 0
    for job in jobs:
        if job.on_token is not None:
            owners.update({start + i: (job, i) for i in range(len(job.prompts))})
        start += len(job.prompts)
    if not owners:
        return None

    def on_step(samples: list[Sample], rows: list[int]) -> None:
        for row in rows:
            owner = owners.get(row)
            if owner is not None:
                job, index = owner
                job.streamed = True
                job.on_token(index, samples[row])
    return on_step
