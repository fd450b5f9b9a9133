"""Fixtures: the embedded backend of a tiny model made from a config, with the LoRA adapter on its actor."""

from __future__ import annotations

import pytest

from agl_plugin_lora.settings import LoraSettings
from agl_plugin_torch.testing import restore_torch_threads  # noqa: F401 (an autouse fixture)
from lora_testkit import adapted_backend


@pytest.fixture
def backend(tmp_path):
    """A torch backend (not serving) whose actor carries a rank-4 adapter on every linear layer."""
    made = adapted_backend(tmp_path, LoraSettings(rank=4, alpha=8))
    yield made
    made.stop_serving()
