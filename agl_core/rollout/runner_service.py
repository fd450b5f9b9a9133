"""``agl runner``: agent workers on any machine, leasing rollouts from a store and calling a gateway.

The workers are the local runner's (:class:`~agl_core.rollout.runner.LocalRunner`):
threads, or an event loop per thread for async agents; leases renewed while
an attempt runs; an attempt past ``timeout_s`` ended ``timed_out``; an
agent's exception recorded as a failure with its text. Whoever queued the
rollouts waits for them with :func:`agl_core.rollout.runner.collect`.

Another host of runners (a Ray actor, a test) calls, with any
:class:`~agl_core.rollout.store.Store`::

    serve_runner(store, gateway_url, agent, *, stop, workers=8, model="policy", api_key="agl",
                 timeout_s=600.0, lease_s=30.0, drain_s=30.0, timeout_setting="timeout_s") -> None

It runs ``workers`` agent workers on rollouts leased from ``store`` until
the :class:`threading.Event` ``stop`` is set; every attempt's
:class:`~agl_core.rollout.agents.LLM` has the base URL
``Gateway.base_url(gateway_url, rollout_id, attempt_id, lease)``, ``model`` and
``api_key`` (the gateway's token, or any string when it has none), and no
``sampling``: the gateway adds the run's to calls that do not set it. Once
``stop`` is set it leases nothing more and gives the running attempts up to
``drain_s`` seconds to end, renewing their leases; an attempt still running
then is left to its lease, so the store hands it to another runner. ``agent``
is the function itself (:func:`agl_core.rollout.agents.load_agent` turns a
``module:function`` spec into it). Importing this module starts nothing.
"""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Callable

from agl_core.gateway.client import TOKEN_ENV as GATEWAY_TOKEN_ENV
from agl_core.gateway.client import check_gateway, check_service
from agl_core.gateway.server import Gateway
from agl_core.http.rules import token_from
from agl_core.http.server import stop_on_signals
from agl_core.rollout.agents import LLM, load_agent
from agl_core.rollout.runner import LocalRunner
from agl_core.rollout.store import Store

log = logging.getLogger("agl_core.rollout.runner_service")


def serve_runner(store: Store, gateway_url: str, agent: Callable, *, stop: threading.Event, workers: int = 8,
                 model: str = "policy", api_key: str = "agl", timeout_s: float = 600.0, lease_s: float = 30.0,
                 drain_s: float = 30.0, timeout_setting: str = "timeout_s") -> None:
    """Run ``workers`` agent workers on rollouts of ``store`` until ``stop`` is set (see the module docstring).

    ``timeout_setting`` names where ``timeout_s`` was set, for the error of an
    attempt that timed out.
    """

    def llm_for(rollout_id: str, attempt_id: str, lease: str) -> LLM:
        return LLM(Gateway.base_url(gateway_url, rollout_id, attempt_id, lease), model, api_key)

    runner = LocalRunner(store, agent, llm_for, n_workers=workers, timeout_s=timeout_s, lease_s=lease_s,
                         timeout_setting=timeout_setting).start()
    try:
        stop.wait()
    finally:
        running = runner.n_running
        if running:
            log.info("stopping: no new rollouts; waiting up to %g s for the %d running", drain_s, running)
        runner.stop(drain_s)
        if runner.n_running:
            log.warning("%d attempts still running are left to their leases: the store requeues them",
                        runner.n_running)


def main(args) -> int:
    """``agl runner``: check the store and the gateway answer, then serve until SIGINT or SIGTERM; 0 once stopped."""
    from agl_core.rollout.store_client import TOKEN_ENV as STORE_TOKEN_ENV
    from agl_core.rollout.store_client import HttpStore

    for flag in ("workers", "timeout_s", "lease_s"):
        if getattr(args, flag) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag):g}")
    for flag in ("connect_timeout_s", "drain_s"):
        if getattr(args, flag) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 0, got {getattr(args, flag):g}")
    try:
        agent = load_agent(args.agent)
    except ValueError as exc:
        raise ValueError(f"--agent {args.agent}: {str(exc).removeprefix(f'rollout.agent={args.agent!r}: ')}") \
            from None
    stop = stop_on_signals()
    store_token = token_from(args.store_token, STORE_TOKEN_ENV)
    gateway_token = token_from(args.gateway_token, GATEWAY_TOKEN_ENV)
    store = HttpStore(args.store, store_token, connect_timeout_s=args.connect_timeout_s)
    try:
        check_service(args.store, store_token, args.connect_timeout_s, "the store service")
        check_gateway(args.gateway, gateway_token, args.connect_timeout_s)
        gc.freeze()  # start-up objects (torch's among them) never die: the collector need not walk them again
        print(f"agl runner: {args.workers} workers leasing from {args.store}, calling {args.gateway}", flush=True)
        serve_runner(store, args.gateway.rstrip("/"), agent, stop=stop, workers=args.workers, model=args.model,
                     api_key=gateway_token or "agl", timeout_s=args.timeout_s, lease_s=args.lease_s,
                     drain_s=args.drain_s, timeout_setting="--timeout-s")
    finally:
        store.close()
    return 0
