"""Every built-in plugin of agl-core on the contract suite (agl_core.testing.contracts), as a third party's would be."""

import pytest
from agl_plugin_sqlite import SqliteStore

from agl_core.rollout.store_client import HttpStore
from agl_core.rollout.store_server import RESERVE_SEQUENCE_IDS, StoreService
from agl_core.testing.contracts import PluginContract, StoreContract


def named(name, **attributes):
    """A PluginContract subclass for the built-in ``name``."""

    @pytest.fixture
    def plugin_name(self):
        return name

    return type(f"Test{name.title().replace('_', '')}Contract", (PluginContract,),
                {"plugin_name": plugin_name, **attributes})


TestEstimatorsContract = named("estimators")
TestConsoleContract = named("console")
TestJsonlContract = named("jsonl")
TestTensorboardContract = named("tensorboard")
TestMemoryStoreContract = named("memory_store")
TestHttpStoreContract = named(
    "http_store",
    not_covered={"register_stores": "TestHttpStore below: the store protocol over a real service per test"})
TestLocalRunnerContract = named(
    "local_runner",
    not_covered={"backend": "needs an agent and a policy server: tests/test_runner.py runs it end to end",
                 "lifecycle": "its on_train_start starts the gateway for the agent: tests/test_runner.py"})
TestRemoteRunnersContract = named(
    "remote_runners",
    not_covered={"backend": "needs runner processes and a store service: tests/test_runner_service.py",
                 "lifecycle": "its on_train_start connects to services: tests/test_runner_service.py"})


class TestValidationContract(PluginContract):
    """The ``validate`` slot in a step of the instant backend (which fills the rest)."""

    @pytest.fixture
    def plugin_name(self):
        return "validation"

    @pytest.fixture
    def plugin_flags(self):
        return ["instant"]


class TestSamplesContract(PluginContract):
    """The samples plugin (opt-in): its settings, its on_train_start and its wrapper of update_actor."""

    @pytest.fixture
    def plugin_name(self):
        return "samples"

    @pytest.fixture
    def plugin_object(self):
        from agl_core.builtin import samples

        return samples


class TestHttpStore(StoreContract):
    """The http store (the store service's client) against a real service on 127.0.0.1 over an SQLite file."""

    @pytest.fixture
    def plugin_name(self):
        return "http_store"

    @pytest.fixture
    def store_name(self):
        return "http"

    @pytest.fixture
    def service_url(self, tmp_path):
        backing = SqliteStore(tmp_path / "rollouts.sqlite", reserve_sequence_ids=RESERVE_SEQUENCE_IDS)
        service = StoreService(backing)
        with service.server() as server:
            yield server.url
        service.close()
        backing.close()

    @pytest.fixture
    def plugin_overrides(self, service_url):
        return [f"plugins.http_store.url={service_url}", "plugins.http_store.connect_timeout_s=10"]

    def test_it_is_the_client_of_the_service(self, store):
        assert isinstance(store, HttpStore)
