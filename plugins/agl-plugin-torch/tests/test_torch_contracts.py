"""agl-plugin-torch on the contract suite: its slots in one full step of a tiny model made from a config (CPU).

Rollouts come from the built-in local runner with a two-turn agent against the
backend's own OpenAI-compatible endpoint; rows from agl-plugin-traces.
"""

import pytest

from agl_core.data import Task
from agl_core.testing.contracts import PluginContract, overrides_of
from agl_plugin_torch.testing import tiny_section


class TestTorchContract(PluginContract):
    not_covered = {"export_model": "tests/test_torch_export.py exports a run's checkpoint and reloads it"}

    @pytest.fixture
    def plugin_name(self):
        return "torch"

    @pytest.fixture
    def plugin_flags(self):
        return ["traces"]

    @pytest.fixture
    def plugin_overrides(self):
        return [*overrides_of(tiny_section(), "plugins.torch"), "rollout.agent=torch_test_agents:short_answers",
                "rollout.n=2", "rollout.timeout_s=30", "data.max_prompt_length=24", "data.max_response_length=24",
                "algorithm.ppo_mini_batch_size=4"]

    @pytest.fixture
    def backend_tasks(self):
        return [Task(id=f"t{i}", input={"text": f"guess a number {i}"}) for i in range(2)]
