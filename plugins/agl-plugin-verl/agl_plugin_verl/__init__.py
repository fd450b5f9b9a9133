"""agl-plugin-verl: verl's Ray worker groups as the compute backend of agl_core.

The same recipe that trains on the embedded backend trains on verl by
enabling this plugin: verl's actor/rollout/reference and critic workers fill
the compute slots of agl_core's loop, verl's rollout servers are the policy
endpoints the gateway forwards agents' calls to, and estimators and policy
losses of either side work by name on the other. Modules, one idea each:

- ``compat``: the verl versions supported, and the start-up check
- ``config``: verl's config for a run (verl's defaults, the recipe's shared keys translated, ``plugins.verl``)
- ``bridge``: agl_core ↔ verl estimators and policy losses
- ``workers``: resource pool and worker groups, built as verl's trainer builds them
- ``cpu``: a CPU engine under verl's own worker classes (tests, CI)
- ``calls``: the driver side of each compute slot (Batch ↔ DataProto ↔ verl's no-padding TensorDict)
- ``rollout``: verl's rollout servers: wake with current weights, sleep for training, URLs
- ``plugin``: the hook implementations
"""

__all__: list[str] = []
