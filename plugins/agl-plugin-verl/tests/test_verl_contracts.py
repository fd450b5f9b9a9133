"""agl-plugin-verl on the contract suite, for what runs on a CPU: the estimators and policy losses it bridges from
verl's registries, called as the core calls them.

Its backend slots need verl's worker groups, with vLLM rollout servers on a GPU: one full step of them is not run
here (declared below, so pytest's summary lists it); tests/test_verl_driver.py drives verl's workers on CPU Ray
(minutes) and scripts/gpu_smoke.sh runs GPU steps.
"""

import pytest

from agl_core.testing.contracts import PluginContract

SUM_PI_SQUARED = "reads sum_pi_squared, which only verl's actor computes (actor.calculate_sum_pi_squared)"


class TestVerlContract(PluginContract):
    not_covered = {
        "backend": "its slots run verl's worker groups: on CPU Ray in tests/test_verl_driver.py (minutes), "
                   "with vLLM rollout on a GPU in scripts/gpu_smoke.sh",
        "lifecycle": "on_train_start starts verl's Ray worker groups: tests/test_verl_driver.py (CPU Ray)",
        "estimator:optimal_token_baseline": SUM_PI_SQUARED,
        "estimator:tir_optimal_token_baseline": SUM_PI_SQUARED,
    }

    @pytest.fixture
    def plugin_name(self):
        return "verl"
