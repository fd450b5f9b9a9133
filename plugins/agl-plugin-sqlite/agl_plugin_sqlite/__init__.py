"""agl-plugin-sqlite: the rollout store ``sqlite``, one SQLite file per run directory.

Enable the plugin and choose the store in a recipe::

    rollout: {store: sqlite}
    plugins:
      sqlite: {}            # or {path: /fast/disk/rollouts.sqlite, keep_consumed: false}
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from agl_core import HOOK_API_VERSION, hookimpl
from agl_plugin_sqlite.store import SqliteStore

AGL_HOOK_API = HOOK_API_VERSION
NAME = "sqlite"
FILENAME = "rollouts.sqlite"

__all__ = ["SqliteConfig", "SqliteStore"]


class SqliteConfig(BaseModel):
    """The recipe section ``plugins.sqlite``."""

    model_config = ConfigDict(extra="forbid")
    path: str | None = Field(None, description=f"the database file (default: <trainer.run_dir>/{FILENAME})")
    keep_consumed: bool = Field(True, description="keep rollouts the trainer consumed in the file as the run's "
                                                  "record (false: delete them and their spans)")
    batch_size: int = Field(512, ge=1, description="most spans per insert transaction")
    max_pending: int = Field(20_000, ge=1, description="spans waiting for the writer before add_spans blocks")
    max_bytes: int | None = Field(None, ge=65536, description="cap on the file's size (null: none); spans that "
                                                               "do not fit fail their own rollouts, and writing "
                                                               "resumes once room is freed")


@hookimpl
def plugin_config_schema():
    return SqliteConfig


@hookimpl
def register_stores(register):
    register(NAME, open_store)


def open_store(ctx) -> SqliteStore:
    """The store of the run ``ctx``, in its run directory unless ``plugins.sqlite.path`` says otherwise."""
    cfg = ctx.plugin_config(NAME)
    path = Path(cfg.path) if cfg.path else Path(ctx.run_dir) / FILENAME
    return SqliteStore(path, batch_size=cfg.batch_size, max_pending=cfg.max_pending,
                       keep_consumed=cfg.keep_consumed, max_bytes=cfg.max_bytes)
