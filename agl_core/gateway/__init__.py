"""The policy gateway: agents' OpenAI-compatible entry point, recording every model call with its token ids."""

from agl_core.gateway.server import Gateway

__all__ = ["Gateway"]
