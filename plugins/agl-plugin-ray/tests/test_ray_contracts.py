"""agl-plugin-ray on the contract suite: it loads and nothing it implements goes unchecked.

Its collect_rollouts runs runner actors on a Ray cluster, which the contract's one-step backend check does not
start; tests/test_ray_runners.py runs it on a real two-node cluster (declared below, listed by pytest as skipped).
"""

import pytest

from agl_core.testing.contracts import PluginContract


class TestRayContract(PluginContract):
    not_covered = {
        "backend": "collect_rollouts on Ray runner actors: tests/test_ray_runners.py on a real two-node cluster",
        "lifecycle": "on_train_start starts the store and gateway services and the actors: tests/test_ray_runners.py",
    }

    @pytest.fixture
    def plugin_name(self):
        return "ray"
