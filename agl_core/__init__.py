"""agl_core: a thin, pluggable RL trainer for LLM agents."""

from agl_core.hookspecs import HOOK_API_VERSION
from agl_core.plugins import hookimpl

__version__ = "0.1.0"
__all__ = ["HOOK_API_VERSION", "hookimpl", "__version__"]
