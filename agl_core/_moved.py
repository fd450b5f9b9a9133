"""Old import paths of modules that moved (issue 43's layout), kept working for one minor version.

``agl_core/__init__.py`` installs :class:`MovedFinder` on ``sys.meta_path``: importing an old name (``import
agl_core.store_server``, ``from agl_core import http_rules``, an unpickled object of an old path) gives the
module at its new place, under both names, with a DeprecationWarning (once: the old name is then cached in
``sys.modules``). There are no files at the old paths, so git sees the moves as renames. The table is
written by the layout script (relayout.py); it names modules only as strings (this module imports nothing of
agl_core, so it may be imported first).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType

REMOVED_IN = "0.3"
"""The minor version that drops the old paths."""

MOVED: dict[str, str] = {
    "agl_core.agents": "agl_core.rollout.agents",
    "agl_core.async_rollouts": "agl_core.rollout.async_rollouts",
    "agl_core.context_record": "agl_core.rollout.context_record",
    "agl_core.http_limits": "agl_core.http.limits",
    "agl_core.http_rules": "agl_core.http.rules",
    "agl_core.http_server": "agl_core.http.server",
    "agl_core.new_plugin": "agl_core.cli.new_plugin",
    "agl_core.plot": "agl_core.builtin.plot",
    "agl_core.recordable": "agl_core.http.recordable",
    "agl_core.runner": "agl_core.rollout.runner",
    "agl_core.runner_service": "agl_core.rollout.runner_service",
    "agl_core.show": "agl_core.cli.show",
    "agl_core.span_batcher": "agl_core.rollout.span_batcher",
    "agl_core.staleness": "agl_core.rollout.staleness",
    "agl_core.store": "agl_core.rollout.store",
    "agl_core.store_client": "agl_core.rollout.store_client",
    "agl_core.store_server": "agl_core.rollout.store_server",
    "agl_core.tasks": "agl_core.rollout.tasks",
    "agl_core.testing_endpoint": "agl_core.testing.endpoint",
    "agl_core.trackers": "agl_core.builtin.trackers",
}
"""Old dotted module name -> its new one."""


class MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module name of :data:`MOVED` and loads it as the module at its new name."""

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec) -> None:
        return None  # a placeholder module: exec_module puts the real one in its place in sys.modules

    def exec_module(self, module: ModuleType) -> None:
        old = module.__name__
        new = MOVED[old]
        warnings.warn(f"{old} moved to {new}: import it from there (the old path goes in agl_core {REMOVED_IN})",
                      DeprecationWarning, stacklevel=2)  # warnings skips the import machinery's frames: the importer
        # The import system returns what sys.modules holds for the name after exec_module: the moved module
        # itself, so the old and new names are one module (one class per class, one state).
        sys.modules[old] = importlib.import_module(new)


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once).

    First: it answers only the old names, and before any other finder, so that a stale copy of an old module
    (an older install's file, an editable install's mapping) is never imported beside the moved one.
    """
    if not any(isinstance(finder, MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())
