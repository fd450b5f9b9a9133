"""pytest plugin for plugin authors (loaded automatically through the ``pytest11`` entry point).

Fixtures:

``plugin_distribution``
    Installs a real plugin distribution for the test: a module plus a
    ``.dist-info`` with its ``agl_core.plugins`` entry points, on ``sys.path``,
    so discovery goes through importlib-metadata exactly as for a pip install.
``make_recipe``
    Builds a validated recipe (with its run directory in ``tmp_path``) and the
    plugin set it asks for.

the contract check :func:`check_plugin`, which loads a plugin object the way
the CLI does and fails with the plugin manager's message if it is refused,
:class:`BatchRecorder`, a pipeline stage that keeps the batches it sees, and
:class:`PolicyEndpoints`, which fills the ``policy_endpoints`` slot with given
URLs (e.g. the test policy endpoint's) for a test of the rollout plane.

The contract suite a plugin's tests subclass is :mod:`agl_core.testing.contracts`; golden metrics (a run
checked against one recorded by earlier code, per kind of machine) are :mod:`agl_core.testing.golden`;
rollouts built by hand (calls, per-call rewards, state keys) are :mod:`agl_core.testing.rollouts`.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any, Callable

import pytest

# The contract classes assert in agl_core's module: pytest rewrites their asserts as it does a test file's.
pytest.register_assert_rewrite("agl_core.testing.contracts")

from agl_core import HOOK_API_VERSION, hookimpl
from agl_core.config import Recipe, load
from agl_core.plugins import Plugin, PluginError, PluginSet


def write_distribution(root: Path, dist_name: str, version: str, modules: dict[str, str],
                       entry_points: dict[str, str]) -> None:
    """Write modules and a ``<dist>-<version>.dist-info`` under ``root`` (a ``sys.path`` entry).

    ``modules`` maps module names to source code; ``entry_points`` maps plugin
    names to ``module:attribute`` (or ``module``) targets.
    """
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist_name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: {version}\n")
    lines = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[agl_core.plugins]\n{lines}")
    (info / "RECORD").write_text("")


@pytest.fixture
def plugin_distribution(tmp_path, monkeypatch) -> Callable[..., Path]:
    """Factory: ``plugin_distribution(dist_name, modules, entry_points, version="1.0")`` → its root."""
    counter = iter(range(1_000_000))

    def make(dist_name: str, modules: dict[str, str], entry_points: dict[str, str], version: str = "1.0") -> Path:
        root = tmp_path / f"site-{next(counter)}"
        root.mkdir()
        write_distribution(root, dist_name, version, modules, entry_points)
        monkeypatch.syspath_prepend(str(root))  # also invalidates the import and metadata caches
        for module in modules:
            monkeypatch.delitem(__import__("sys").modules, module, raising=False)
        return root

    return make


@pytest.fixture
def make_recipe(tmp_path) -> Callable[..., tuple[Recipe, PluginSet]]:
    """Factory: ``make_recipe(overrides=[...], plugins=[(name, obj)], flags=[...])`` → (recipe, plugin set).

    The run directory is ``tmp_path/run`` unless an override sets it. A plugin object the plugin manager
    refuses (no ``AGL_HOOK_API``, an unknown hook, …) raises ``ConfigError`` with the reason.
    """

    def make(overrides: list[str] = (), plugins: list[tuple[str, Any]] = (), flags: list[str] = ()):
        overrides = [f"trainer.run_dir={tmp_path / 'run'}", "trainer.progress=false", *overrides]
        return load(None, overrides, list(flags), extra_plugins=list(plugins))

    return make


def check_plugin(obj: Any, name: str = "plugin") -> Plugin:
    """Load ``obj`` as the CLI would; raise PluginError with the manager's reason if refused."""
    plugin = PluginSet.load(extra=[(name, obj)]).plugins[name]
    if plugin.status != "active":
        raise PluginError(f"plugin {name!r} was refused: {plugin.reason}")
    return plugin


class BatchRecorder:
    """A ``post_process_batch`` stage that keeps every batch it sees and passes it on unchanged.

    Pass it as an extra plugin. ``order`` is its ``AGL_ORDER``: the default
    20 runs after the built-in stages (it sees the rows), 1 before them (it
    sees ``batch.meta["rollouts"]`` only).
    """

    AGL_HOOK_API = HOOK_API_VERSION

    def __init__(self, order: int = 20):
        self.AGL_ORDER = order
        self.batches: list = []

    @hookimpl
    def post_process_batch(self, ctx, batch):
        self.batches.append(batch)
        return batch


class PolicyEndpoints:
    """A stand-in backend for tests of the rollout plane: the policy is served at ``urls`` (``…/v1``).

    Pass it as an extra plugin, e.g. ``("endpoints", PolicyEndpoints([url]))``.
    """

    AGL_HOOK_API = HOOK_API_VERSION

    def __init__(self, urls: list[str]):
        self.urls = urls

    @hookimpl
    def policy_endpoints(self, ctx):
        return self.urls
