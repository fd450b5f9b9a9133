"""``agl serve gateway``: the gateway alone in its process, recording into a store service; and its clients.

Agents on other machines reach a gateway served this way; several can serve
behind one store. The trainer sets each step what it serves with
:func:`set_policy`, runners check it with :func:`check_gateway`::

    set_policy(gateway_url, urls=["http://gpu-0:8000/v1"], weight_version=3,
               sampling={"temperature": 1.0, "max_tokens": 512}, seed=0, token=None)
    check_gateway(gateway_url, token=None, connect_timeout_s=60.0)

Both retry a gateway that does not answer (refused or timed-out connections)
with exponential backoff for up to ``connect_timeout_s``, logging each retry,
then raise a ValueError naming the URL; a gateway that refuses the token or
the request is a ValueError at once, with the gateway's reason
(:func:`call_service`, :func:`check_service`: the same for any service of
the project).
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

import httpx
from pydantic import ValidationError

from agl_core.config import ConfigError, GatewayConfig
from agl_core.gateway.server import ADMIN_POLICY, TOKEN_ENV, Gateway
from agl_core.http_rules import require_token_off_loopback, token_from
from agl_core.http_server import stop_on_signals

log = logging.getLogger("agl_core.gateway.service")
STORE_CONNECT_TIMEOUT_S = 60.0
"""How long the gateway waits at start-up for its store service to answer."""
FLAGGED = ("host", "port", "token")
"""Gateway settings with flags of their own, refused in ``--config``."""
REQUEST_TIMEOUT_S = 30.0
FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.25, 5.0


def main(args) -> int:
    """Serve a gateway over the store service ``args.store`` until SIGINT or SIGTERM; print its URL once it serves."""
    from agl_core.store_client import TOKEN_ENV as STORE_TOKEN_ENV
    from agl_core.store_client import HttpStore

    config = gateway_config(args.config, host=args.host, port=args.port, token=args.token)
    require_token_off_loopback("the gateway", config.host, token_from(config.token, TOKEN_ENV),
                               f"--token (or ${TOKEN_ENV})")
    stop = stop_on_signals()
    store_token = token_from(args.store_token, STORE_TOKEN_ENV)
    check_service(args.store, store_token, STORE_CONNECT_TIMEOUT_S, "the store service")
    store = HttpStore(args.store, store_token)
    try:
        server = Gateway(store, config, upstreams=args.upstream).serve()
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
            raise ConfigError(f"--config {item!r}: set {key} with --{key}")
        if key not in GatewayConfig.model_fields:
            allowed = ", ".join(k for k in GatewayConfig.model_fields if k not in FLAGGED)
            raise ConfigError(f"--config {item!r}: unknown gateway setting {key!r} (allowed: {allowed})")
        settings[key] = value
    try:
        return GatewayConfig(**settings, **flags)
    except ValidationError as exc:
        err = exc.errors()[0]
        name = str(err["loc"][0])
        where = f"--{name}" if name in FLAGGED else f"--config {name}={settings.get(name)}"
        raise ConfigError(f"{where}: {err['msg']}") from None


# ---------------------------------------------------------------- clients


def set_policy(gateway_url: str, *, urls: list[str], weight_version: int | None, sampling: dict[str, Any] | None = None,
               seed: int | None = None, token: str | None = None, connect_timeout_s: float = 60.0) -> dict[str, Any]:
    """Point the gateway at ``gateway_url`` to the policy servers ``urls``, with what its spans and calls get.

    ``weight_version`` is recorded on the spans (unless the policy server
    reports its own); ``sampling`` is added to calls that do not set it;
    ``seed`` (None: none) seeds calls that set none (see
    :func:`~agl_core.gateway.server.call_seed`). Returns the gateway's policy
    as it now is.
    """
    body = {"urls": list(urls), "weight_version": weight_version, "sampling": sampling or {}, "seed": seed}
    return call_service(gateway_url, "PUT", ADMIN_POLICY, token, connect_timeout_s, "the gateway", json=body).json()


def check_gateway(gateway_url: str, token: str | None = None, connect_timeout_s: float = 60.0) -> None:
    """Return once the gateway at ``gateway_url`` answers and takes ``token``; ValueError naming the URL otherwise."""
    check_service(gateway_url, token, connect_timeout_s, "the gateway")


def check_service(url: str, token: str | None, connect_timeout_s: float, what: str) -> None:
    """Return once the service of the project at ``url`` (``what``) answers ``/healthz`` and takes ``token``."""
    health = call_service(url, "GET", "/healthz", token, connect_timeout_s, what).json()
    if len(health) == 1:  # {"ok": true} only: what it serves is for callers with the token
        raise ValueError(f"{what} at {url} refuses the token given: "
                         f"{'it requires one' if token is None else 'it is not its token'}")


def call_service(url: str, method: str, path: str, token: str | None, connect_timeout_s: float, what: str,
                 **kwargs: Any) -> httpx.Response:
    """One request to a service of the project, retried while it does not answer; ValueError unless it says 2xx.

    Refused and timed-out connections are retried with exponential backoff,
    each retry logged, for up to ``connect_timeout_s``; then the ValueError
    names ``what`` and its URL.
    """
    target = url.rstrip("/") + path
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    deadline = time.monotonic() + connect_timeout_s
    backoff = FIRST_BACKOFF_S
    while True:
        try:
            response = httpx.request(method, target, headers=headers, timeout=REQUEST_TIMEOUT_S, **kwargs)
            break
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ValueError(f"{what} at {url} does not answer ({exc or type(exc).__name__}); "
                                 f"gave up after {connect_timeout_s:g} s") from None
            log.warning("%s at %s does not answer (%s); retrying in %.2g s", what, url, exc, min(backoff, left))
            time.sleep(min(backoff, left))
            backoff = min(backoff * 2, MAX_BACKOFF_S)
        except httpx.HTTPError as exc:
            raise ValueError(f"{what} at {url}: {method} {path} failed: {exc or type(exc).__name__}") from None
    if response.status_code >= 400:
        try:
            reason = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            reason = response.text[:200]
        raise ValueError(f"{what} at {url} answered {method} {path} with {response.status_code}: {reason}")
    return response
