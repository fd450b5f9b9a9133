"""Fixtures shared by the core's tests."""

import pytest

from agl_core.testing.endpoint import TestEndpoint


@pytest.fixture
def endpoint():
    """The test policy endpoint served on 127.0.0.1; ``endpoint.url`` is its OpenAI base URL (``…/v1``)."""
    ep = TestEndpoint()
    server = ep.serve()
    ep.url = server.url + "/v1"
    yield ep
    server.stop()
