"""``agl`` commands: serve store, serve gateway, runner."""

from __future__ import annotations


def cmd_serve_store(args) -> int:
    from agl_core.rollout.store_server import main as serve_store

    return serve_store(args)


def cmd_serve_gateway(args) -> int:
    from agl_core.gateway.service import main as serve_gateway

    return serve_gateway(args)


def cmd_runner(args) -> int:
    from agl_core.rollout.runner_service import main as run_runner

    return run_runner(args)
