"""Fixtures: the embedded backend of a tiny model made from a config, with the LoRA adapter on its actor."""

from __future__ import annotations

import pytest
import torch

from agl_plugin_lora.settings import LoraSettings
from lora_testkit import adapted_backend


@pytest.fixture(autouse=True)
def _threads():
    # The backend sets torch's thread count for its run; give it back so other tests keep their own.
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def backend(tmp_path):
    """A torch backend (not serving) whose actor carries a rank-4 adapter on every linear layer."""
    made = adapted_backend(tmp_path, LoraSettings(rank=4, alpha=8))
    yield made
    made.stop_serving()
