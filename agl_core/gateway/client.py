"""Clients of the project's services over HTTP: point a gateway at a policy, check that a service answers.

The trainer sets each step what a gateway serves with :func:`set_policy`,
runners check it with :func:`check_gateway`::

    set_policy(gateway_url, urls=["http://gpu-0:8000/v1"], weight_version=3,
               sampling={"temperature": 1.0, "max_tokens": 512}, seed=0, token=None)
    check_gateway(gateway_url, token=None, connect_timeout_s=60.0)

Both retry a gateway that does not answer (refused or timed-out connections)
with exponential backoff for up to ``connect_timeout_s``, logging each retry,
then raise a ValueError naming the URL; a gateway that refuses the token or
the request is a ValueError at once, with the gateway's reason
(:func:`call_service`, :func:`check_service`: the same for any service of
the project). This module imports nothing of the gateway's server (Starlette,
uvicorn), so plugins that only talk to a gateway load fast.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("agl_core.gateway.client")
TOKEN_ENV = "AGL_GATEWAY_TOKEN"
"""The environment variable holding a gateway's bearer token (the agents')."""
ADMIN_TOKEN_ENV = "AGL_GATEWAY_ADMIN_TOKEN"
"""The environment variable holding a gateway's admin token (the trainer's: :func:`set_policy`)."""
ADMIN_POLICY = "/v1/admin/policy"
"""The gateway's route that sets what it serves."""
REQUEST_TIMEOUT_S = 30.0
FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.25, 5.0


def set_policy(gateway_url: str, *, urls: list[str], weight_version: int | None, sampling: dict[str, Any] | None = None,
               seed: int | None = None, token: str | None = None, connect_timeout_s: float = 60.0) -> dict[str, Any]:
    """Point the gateway at ``gateway_url`` to the policy servers ``urls``, with what its spans and calls get.

    ``weight_version`` is recorded on the spans (unless the policy server
    reports its own); ``sampling`` is added to calls that do not set it;
    ``seed`` (None: none) seeds calls that set none (see
    :func:`~agl_core.gateway.server.call_seed`). ``token`` is the gateway's
    admin token (never the agents'). Returns the gateway's policy as it now is.
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
    import httpx  # here, not with the module: `agl plugins` loads the plugins that import this one

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
