"""agl-plugin-torch: the embedded PyTorch + transformers backend of agl_core.

One process holds the policy (a local Hugging Face model, or a small model
made from a config with a word tokenizer), serves it on an OpenAI-compatible
endpoint that returns token ids and log-probs, and trains it with the core's
PPO loss pieces. Modules, one idea each:

- ``settings``: the recipe section ``plugins.torch``
- ``modeling``: model and tokenizer, made or loaded; the critic's value head
- ``sampling``: batched sampling with per-row parameters and log-probs
- ``engine``: the batching worker that serves concurrent requests
- ``policies``: several policies (named adapters) on one actor: routing rows, per-policy updates
- ``per_row_lora``: the batched per-row LoRA kernel of a batch mixing adapters
- ``server``: the OpenAI-compatible HTTP endpoint
- ``forward``: log-probs, entropy and values of training rows
- ``training``: actor and critic updates
- ``backend``: the run's state and its checkpoints
- ``plugin``: the hook implementations
"""

from agl_plugin_torch.plugin import plugin

__all__ = ["plugin"]
