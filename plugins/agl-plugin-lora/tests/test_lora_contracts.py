"""agl-plugin-lora on the contract suite: its compute_ref_logprob slot (the actor with its adapter off) in one
full step of the embedded backend's tiny model (CPU), and its lifecycle with a checkpoint."""

import pytest

from agl_core.data import Task
from agl_core.testing.contracts import PluginContract, overrides_of
from agl_plugin_torch.testing import tiny_section


class TestLoraContract(PluginContract):
    not_covered = {
        "register_actor_transforms": "no contract runs an actor transform: tests/test_lora_plugin.py and "
                                     "tests/test_lora_reference.py check the adapter it puts on the actor",
        "export_model": "tests/test_lora_export.py exports the adapter and the merged model and reloads them",
    }

    @pytest.fixture
    def plugin_name(self):
        return "lora"

    @pytest.fixture
    def plugin_flags(self):
        return ["torch", "traces"]

    @pytest.fixture
    def plugin_overrides(self):
        return [*overrides_of(tiny_section(), "plugins.torch"), "plugins.lora.rank=4", "plugins.lora.alpha=8",
                "plugins.slots.compute_ref_logprob=lora", "algorithm.policy_loss.use_kl_loss=true",
                "rollout.agent=lora_test_agents:say_five", "rollout.n=2", "rollout.timeout_s=30",
                "data.max_prompt_length=24", "data.max_response_length=24", "algorithm.ppo_mini_batch_size=4"]

    @pytest.fixture
    def backend_tasks(self):
        return [Task(id=f"t{i}", input={"text": f"guess a number {i}"}) for i in range(2)]
