"""agl-plugin-instant on the contract suite: every backend slot in one full step, its stage, its lifecycle."""

import pytest

from agl_core.testing.contracts import PluginContract


class TestInstantContract(PluginContract):
    @pytest.fixture
    def plugin_name(self):
        return "instant"
