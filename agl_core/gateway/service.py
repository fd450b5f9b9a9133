"""``agl serve gateway``: the gateway alone in its process, recording into a store service.

Agents on other machines reach a gateway served this way; several can serve
behind one store. Its admin route (``PUT /v1/admin/policy``) takes the admin
token in ``$AGL_GATEWAY_ADMIN_TOKEN``, never the agents' ``--token``. Its
clients (the trainer's :func:`~agl_core.gateway.client.set_policy`, the
runners' :func:`~agl_core.gateway.client.check_gateway`) are in
:mod:`agl_core.gateway.client`.
"""

from __future__ import annotations

import gc
from typing import Any

from pydantic import ValidationError

from agl_core.config import ConfigError, GatewayConfig
from agl_core.gateway.client import ADMIN_TOKEN_ENV, TOKEN_ENV, check_service
from agl_core.gateway.server import Gateway
from agl_core.http.rules import require_token_off_loopback, token_from
from agl_core.http.server import stop_on_signals

STORE_CONNECT_TIMEOUT_S = 60.0
"""How long the gateway waits at start-up for its store service to answer."""
FLAGGED = ("host", "port", "token", "max_connections")
"""Gateway settings with flags of their own, refused in ``--config``."""
FROM_ENVIRONMENT = {"admin_token": ADMIN_TOKEN_ENV}
"""Gateway settings read from the environment only (a command line is readable by other users)."""


def main(args) -> int:
    """Serve a gateway over the store service ``args.store`` until SIGINT or SIGTERM; print its URL once it serves."""
    from agl_core.rollout.store_client import TOKEN_ENV as STORE_TOKEN_ENV
    from agl_core.rollout.store_client import HttpStore

    config = gateway_config(args.config, host=args.host, port=args.port, token=args.token,
                            max_connections=args.max_connections)
    require_token_off_loopback("the gateway", config.host, token_from(config.token, TOKEN_ENV),
                               f"--token (or ${TOKEN_ENV})")
    stop = stop_on_signals()
    store_token = token_from(args.store_token, STORE_TOKEN_ENV)
    check_service(args.store, store_token, STORE_CONNECT_TIMEOUT_S, "the store service")
    store = HttpStore(args.store, store_token)
    try:
        server = Gateway(store, config, upstreams=args.upstream, policies=args.policies).serve()
        # Start-up objects never die: keeping them out of the collector's scans keeps its pauses short.
        gc.freeze()
        print(server.url, flush=True)
        stop.wait()
        server.stop()
    finally:
        store.close()
    return 0


def gateway_config(items: list[str], **flags: Any) -> GatewayConfig:
    """The gateway's settings from ``--config KEY=VALUE`` items and its own flags; ValueError naming a bad item."""
    settings: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--config {item!r} is not of the form KEY=VALUE (e.g. --config max_n=16)")
        if key in FLAGGED:
            raise ConfigError(f"--config {item!r}: set {key} with --{key.replace('_', '-')}")
        if key in FROM_ENVIRONMENT:
            raise ConfigError(f"--config {key}=...: set {key} in ${FROM_ENVIRONMENT[key]} (a command line is "
                              f"readable by other users)")
        if key not in GatewayConfig.model_fields:
            allowed = ", ".join(k for k in GatewayConfig.model_fields if k not in (*FLAGGED, *FROM_ENVIRONMENT))
            raise ConfigError(f"--config {item!r}: unknown gateway setting {key!r} (allowed: {allowed})")
        settings[key] = value
    try:
        return GatewayConfig(**settings, **flags)
    except ValidationError as exc:
        err = exc.errors()[0]
        name = str(err["loc"][0])
        where = f"--{name.replace('_', '-')}" if name in FLAGGED else f"--config {name}={settings.get(name)}"
        raise ConfigError(f"{where}: {err['msg']}") from None
