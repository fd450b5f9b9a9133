"""agl_core: a thin, pluggable RL trainer for LLM agents."""

from agl_core import _moved

_moved.install()  # old import paths of moved modules keep working, with a DeprecationWarning

from agl_core.hookspecs import HOOK_API_VERSION
from agl_core.plugins import hookimpl
from agl_core.rollout.agents import LLM, agent, emit_annotation, emit_reward, emit_state_key, per_thread

__version__ = "0.1.0"
__all__ = ["HOOK_API_VERSION", "LLM", "agent", "emit_annotation", "emit_reward", "emit_state_key", "hookimpl",
           "per_thread", "__version__"]
