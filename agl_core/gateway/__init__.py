"""The policy gateway: agents' OpenAI-compatible entry point, recording every model call with its token ids."""

from agl_core.gateway.server import Gateway, is_loopback

__all__ = ["Gateway", "is_loopback"]
