"""agl-plugin-sqlite on the contract suite: the store protocol's lease, requeue and idempotence semantics."""

import pytest

from agl_core.testing.contracts import PluginContract, StoreContract


class TestSqliteContract(PluginContract):
    @pytest.fixture
    def plugin_name(self):
        return "sqlite"


class TestSqliteStore(StoreContract):
    @pytest.fixture
    def plugin_name(self):
        return "sqlite"

    @pytest.fixture
    def store_name(self):
        return "sqlite"
