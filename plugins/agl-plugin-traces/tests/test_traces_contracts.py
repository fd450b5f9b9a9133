"""agl-plugin-traces on the contract suite: its aggregators, its rollout-level estimators, its pipeline stage."""

import pytest

from agl_core.testing.contracts import PluginContract


class TestTracesContract(PluginContract):
    @pytest.fixture
    def plugin_name(self):
        return "traces"


class TestTracesTrajectoryContract(TestTracesContract):
    """The same with the trajectory aggregator as the stage's (consecutive calls merged into one row)."""

    @pytest.fixture
    def plugin_overrides(self):
        return ["plugins.traces.aggregator=trajectory"]
