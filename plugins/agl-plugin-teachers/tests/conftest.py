"""Fixtures: the embedded backend's tiny model (agl-plugin-torch, made from a config), the test endpoint."""

from __future__ import annotations

import pytest

from agl_core.testing.endpoint import TestEndpoint
from agl_plugin_torch.backend import create
from agl_plugin_torch.settings import TorchConfig
from agl_plugin_torch.testing import restore_torch_threads, tiny_section  # noqa: F401 (an autouse fixture)


@pytest.fixture
def backend(tmp_path):
    """A tiny policy's backend in ``tmp_path/run`` (not serving)."""
    made = create(TorchConfig.model_validate(tiny_section()), tmp_path / "run", seed=0, with_critic=False)
    yield made
    made.stop_serving()


@pytest.fixture
def checkpoint(tmp_path, backend):
    """The backend's actor saved as a Hugging Face model directory (what `agl export` writes)."""
    path = tmp_path / "teacher"
    backend.actor.save_pretrained(path)
    backend.tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def endpoint():
    """The test endpoint (deterministic log-probs, failure injection) on 127.0.0.1."""
    test = TestEndpoint()
    server = test.serve()
    test.url = server.url + "/v1"
    yield test
    server.stop()
