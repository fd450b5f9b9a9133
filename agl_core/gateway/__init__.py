"""The policy gateway: agents' OpenAI-compatible entry point, recording every model call with its token ids."""

__all__ = ["Gateway"]


def __getattr__(name: str):
    # The server (Starlette, uvicorn) is imported when first asked for: the gateway's clients
    # (agl_core.gateway.client) and translations load without it.
    if name == "Gateway":
        from agl_core.gateway.server import Gateway

        return Gateway
    raise AttributeError(f"module 'agl_core.gateway' has no attribute {name!r}")
