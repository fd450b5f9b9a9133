"""Heavy modules (torch, tensordict, transformers, …) imported on first use, not when their user is imported.

Importing a plugin must stay cheap: ``agl plugins`` imports every installed
plugin, and a module-level ``import torch`` in a plugin (or in a core module
it imports, such as :mod:`agl_core.data`) cost seconds there before any hook
ran.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class LazyModule:
    """Stands for the module ``name`` in the namespace ``namespace`` until an attribute is first read.

    Then the module is imported and put in place of this object under
    ``alias`` (so later reads cost what a plain global costs).
    """

    __slots__ = ("_name", "_namespace", "_alias")

    def __init__(self, name: str, namespace: dict[str, Any], alias: str | None = None):
        self._name, self._namespace, self._alias = name, namespace, alias or name.rpartition(".")[2]

    def _load(self) -> ModuleType:
        module = importlib.import_module(self._name)
        self._namespace[self._alias] = module
        return module

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._load(), attr)

    def __repr__(self) -> str:
        return f"<lazily imported module {self._name!r}>"
