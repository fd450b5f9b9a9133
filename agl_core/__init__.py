"""agl_core: a thin, pluggable RL trainer for LLM agents."""

from agl_core.agents import LLM, agent, emit_annotation, emit_reward, emit_state_key, per_thread
from agl_core.hookspecs import HOOK_API_VERSION
from agl_core.plugins import hookimpl

__version__ = "0.1.0"
__all__ = ["HOOK_API_VERSION", "LLM", "agent", "emit_annotation", "emit_reward", "emit_state_key", "hookimpl",
           "per_thread", "__version__"]
