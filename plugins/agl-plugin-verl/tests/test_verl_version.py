"""The version guard: supported verl releases pass, anything else is refused at start-up with both versions named."""

from __future__ import annotations

import pytest

from agl_core.config import load

from agl_plugin_verl import compat, plugin
from agl_plugin_verl.compat import SUPPORTED, UnsupportedVerlError, verl_version


@pytest.mark.parametrize("installed", ["0.7.0", "0.7.1", "0.8.0", "0.9.0rc1", "0.9.1"])
def test_supported_versions_pass(monkeypatch, installed):
    monkeypatch.setattr(compat, "installed_verl_version", lambda: installed)
    assert str(verl_version()) == installed


@pytest.mark.parametrize("installed", ["0.5.0", "0.6.1", "0.10.0", "1.0.0"])
def test_unsupported_version_is_refused_naming_both(monkeypatch, installed):
    monkeypatch.setattr(compat, "installed_verl_version", lambda: installed)
    with pytest.raises(UnsupportedVerlError) as err:
        verl_version()
    assert f"verl {installed} is installed" in str(err.value)
    assert f"supports verl {SUPPORTED}" in str(err.value)


def test_missing_verl_is_refused_with_the_install_line(monkeypatch):
    monkeypatch.setattr(compat, "installed_verl_version", lambda: None)
    with pytest.raises(UnsupportedVerlError, match=r"verl is not installed: pip install 'verl>=0.7,<0.10'"):
        verl_version()


def test_a_recipe_enabling_the_plugin_fails_at_load_not_in_a_step(monkeypatch, tmp_path):
    """The registration hooks run when the plugin set is built: before any worker, rollout or step."""
    monkeypatch.setattr(compat, "installed_verl_version", lambda: "0.6.1")
    from agl_core.components import Components

    _, plugins = load(None, [f"trainer.run_dir={tmp_path}", "plugins.verl.trainer.nnodes=1"])
    with pytest.raises(UnsupportedVerlError, match="verl 0.6.1 is installed"):
        Components.collect(plugins)


def test_on_train_start_checks_first(monkeypatch):
    monkeypatch.setattr(compat, "installed_verl_version", lambda: "0.10.2")
    with pytest.raises(UnsupportedVerlError, match="verl 0.10.2 is installed"):
        plugin.on_train_start(ctx=None)  # refused before the context is read
