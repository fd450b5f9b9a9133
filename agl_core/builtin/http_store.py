"""Built-in plugin ``http_store``: the store ``http``, a store service (``agl serve store``) reached by URL.

Choose it in a recipe and say where the service is::

    rollout: {store: http}
    plugins:
      http_store: {url: "http://10.0.0.5:8765"}     # token: default $AGL_STORE_TOKEN

Every process of a run that names the same URL (trainer, ``agl serve
gateway``, ``agl runner``) works on the same rollouts. See
:mod:`agl_core.rollout.store_client` for retries and what they mean.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from agl_core import HOOK_API_VERSION, hookimpl
from agl_core.config import ConfigError

AGL_HOOK_API = HOOK_API_VERSION
NAME = "http_store"


class HttpStoreConfig(BaseModel):
    """The recipe section ``plugins.http_store``."""

    model_config = ConfigDict(extra="forbid")
    url: str | None = Field(None, description="the store service's URL, http://host:port as agl serve store "
                                              "prints it (required with rollout.store: http)")
    token: str | None = Field(None, description="its bearer token (default: $AGL_STORE_TOKEN)")
    connect_timeout_s: float = Field(60.0, gt=0, description="how long a call keeps retrying a service that does "
                                                             "not answer before it fails")
    batch_size: int = Field(256, ge=1, description="most spans per upload")
    max_pending: int = Field(20_000, ge=1, description="spans waiting for upload before add_spans blocks")


@hookimpl
def plugin_config_schema():
    return HttpStoreConfig


@hookimpl
def register_stores(register):
    register("http", open_store)


def open_store(ctx):
    """The client of the service at ``plugins.http_store.url``."""
    from agl_core.rollout.store_client import HttpStore  # imports agl_core.data (torch): only runs that use it pay

    cfg = ctx.plugin_config(NAME)
    if not cfg.url:
        raise ConfigError("rollout.store is 'http': set plugins.http_store.url to the store service's URL "
                          "(agl serve store --db PATH prints it)")
    try:
        return HttpStore(cfg.url, cfg.token, connect_timeout_s=cfg.connect_timeout_s, batch_size=cfg.batch_size,
                         max_pending=cfg.max_pending)
    except ValueError as exc:
        raise ConfigError(f"plugins.http_store.url: {exc}") from None
