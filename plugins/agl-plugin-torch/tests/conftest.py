"""Fixtures: a tiny model made from a config (no download), its backend, and its endpoint served on 127.0.0.1."""

from __future__ import annotations

import pytest
from openai import OpenAI

from agl_plugin_torch.backend import create
from agl_plugin_torch.settings import TorchConfig
from agl_plugin_torch.testing import restore_torch_threads, tiny_section  # noqa: F401 (an autouse fixture)


@pytest.fixture
def config() -> TorchConfig:
    return TorchConfig.model_validate(tiny_section())


@pytest.fixture
def backend(tmp_path, config):
    """The backend of a run in ``tmp_path`` (not serving)."""
    made = create(config, tmp_path, seed=0, with_critic=False)
    yield made
    made.stop_serving()


@pytest.fixture
def served(backend):
    """The backend with its endpoint started."""
    backend.start_serving("policy")
    return backend


@pytest.fixture
def client(served) -> OpenAI:
    """The real openai client, pointed at the served endpoint (bounded waits, no retries)."""
    return OpenAI(base_url=served.url, api_key="unused", max_retries=0, timeout=30)
