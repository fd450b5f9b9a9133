"""agl-plugin-traces: finished rollouts (token-exact model calls and rewards) → the core training Batch.

Modules, one idea each:

``calls``       spans → the trainable model calls of a rollout, with their rewards
``rows``        rows → padded tensors, vectorised (:class:`RowBuilder`)
``transition``  the ``transition`` aggregator: one row per call
``trajectory``  the ``trajectory`` aggregator: calls that extend one context merge into one row
``mismatch``    classes of prefix breaks (template / retokenization / other) and their log
``filters``     zero-variance groups, rows per rollout
``advantage``   rollout-level outcome estimators (``grpo_rollout``, …)
``settings``    the recipe section ``plugins.traces``
``plugin``      the hooks (the entry point ``traces``)
"""

import importlib

__version__ = "0.1.0"
__all__ = ["Call", "rollout_calls", "to_triplets", "trajectory_batch", "transition_batch"]
_HOME = {"Call": "calls", "rollout_calls": "calls", "to_triplets": "calls", "trajectory_batch": "trajectory",
         "transition_batch": "transition"}


def __getattr__(name: str):
    # Imported on first use: the entry point (agl_plugin_traces.plugin) imports this package, and the
    # aggregators import torch, which `agl plugins` must not pay for.
    if name in _HOME:
        return getattr(importlib.import_module(f"agl_plugin_traces.{_HOME[name]}"), name)
    raise AttributeError(f"module 'agl_plugin_traces' has no attribute {name!r}")
