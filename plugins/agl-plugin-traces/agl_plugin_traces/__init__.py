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

from agl_plugin_traces.calls import Call, rollout_calls, to_triplets
from agl_plugin_traces.trajectory import trajectory_batch
from agl_plugin_traces.transition import transition_batch

__version__ = "0.1.0"
__all__ = ["Call", "rollout_calls", "to_triplets", "trajectory_batch", "transition_batch"]
