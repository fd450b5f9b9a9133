"""The agent API: what an agent is, what it is given, and how it reports rewards.

An agent is a plain function, sync or async::

    def agent(task: Task, llm: LLM) -> float | None

It talks to ``llm.base_url`` with any OpenAI-compatible client (the official
``openai`` client unchanged) and returns its reward, or None. On the way it
may call :func:`emit_reward` for intermediate rewards (a reward rewards the
model call before it), :func:`emit_state_key` to name the state its next
model call is made in (step-level estimators compare calls made in the same
state) and :func:`emit_annotation` for anything worth keeping with the trace. Every
model call it makes is recorded by the gateway behind ``llm.base_url``.

A recipe names the agent with ``rollout.agent``: ``package.module:function``,
or a name that an installed distribution registers in the entry-point group
``agl_core.agents``. The :func:`agent` decorator gives it the name recorded on
its spans.
"""

from __future__ import annotations

import contextlib
import contextvars
import decimal
import importlib
import inspect
import json
import math
import numbers
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

import importlib_metadata

if TYPE_CHECKING:  # agl_core.data imports torch; `import agl_core` stays light without it
    from agl_core.data import Task
    from agl_core.rollout.store import Store

ENTRY_POINT_GROUP = "agl_core.agents"
STATE_KEY = "state_key"
"""The annotation attribute (and triplet metadata key) that names the state of a model call."""

T = TypeVar("T")


@dataclass(frozen=True)
class LLM:
    """The model an agent calls for one rollout: an OpenAI-compatible ``base_url`` and what to send it.

    ``base_url`` is unique to the rollout's attempt (the gateway files each
    call under it), so create the client inside the agent:
    ``OpenAI(base_url=llm.base_url, api_key=llm.api_key)``. ``sampling``
    holds the recipe's sampling parameters; the gateway applies them to calls
    that do not set them, so passing them is optional.
    """

    base_url: str
    model: str
    api_key: str
    sampling: dict[str, Any] = field(default_factory=dict)

    def for_role(self, role: str) -> LLM:
        """The handle of one role of a multi-agent rollout: its calls go to the policy ``role`` names.

        In a run with a ``policies`` section every call made through this
        handle's ``base_url`` is ``role``'s, whatever ``model`` the client
        sends (an SDK agent written against another model name included), and
        ``model`` is ``role``. Sending ``model=role`` through the plain handle
        reaches the same policy. A role that is not a policy of the run is
        refused with 404 naming the policies.
        """
        if not self.base_url.endswith(ROLE_URL_TAIL):
            raise ValueError(f"llm.for_role needs the gateway's base URL (…{ROLE_URL_TAIL}), got {self.base_url!r}")
        return replace(self, base_url=f"{self.base_url[:-len(ROLE_URL_TAIL)]}/role/{role}{ROLE_URL_TAIL}", model=role)


ROLE_URL_TAIL = "/v1"


def per_thread(make: Callable[[], T]) -> Callable[[], T]:
    """A function that returns ``make()``'s result for the calling thread, made at the thread's first call.

    For an agent's HTTP client: the runner plays games on many worker
    threads, and one client shared by all of them makes every call take
    its connection pool's lock twice (httpx's pool, whose bookkeeping under
    that lock grows with the connections); with 32 workers the agents
    spent more time waiting for it than calling. One client per worker
    thread keeps the pool's reuse of connections without the contention::

        HTTP = per_thread(DefaultHttpxClient)

        def my_agent(task, llm):
            client = OpenAI(base_url=llm.base_url, api_key=llm.api_key, http_client=HTTP())
    """
    local = threading.local()

    def mine() -> T:
        made = getattr(local, "made", None)
        if made is None:
            made = local.made = make()
        return made
    return mine


def agent(name: str | None = None) -> Callable[[Callable], Callable]:
    """Decorator: name an agent (recorded as ``agent_name`` on its spans) and check its signature.

    ``@agent()`` uses the function's name. The function must accept ``(task, llm)``.
    """

    def mark(fn: Callable) -> Callable:
        check_signature(fn)
        fn.agl_agent_name = name or fn.__name__
        return fn

    return mark


def agent_name(fn: Callable) -> str:
    """The name an agent's spans carry: the one given to :func:`agent`, else its qualified name."""
    return getattr(fn, "agl_agent_name", None) or getattr(fn, "__qualname__", type(fn).__name__)


def check_signature(fn: Callable) -> None:
    """Raise TypeError unless ``fn`` can be called as ``fn(task, llm)``."""
    if not callable(fn):
        raise TypeError(f"an agent must be callable, got {type(fn).__name__}")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        raise TypeError(f"agent {agent_name(fn)!r} must accept (task, llm), its signature is "
                        f"{inspect.signature(fn)}") from None


def load_agent(spec: str) -> Callable:
    """The agent named by the recipe key ``rollout.agent`` (``module:attr`` or an ``agl_core.agents`` name).

    A module is also looked for in the working directory. Raises ValueError
    with what was tried and what exists.
    """
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        # As uvicorn does for its apps: `agl train` started in a project finds that project's agents.
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"rollout.agent={spec!r}: cannot import {module_name!r}: {exc}") from None
        fn = module
        for part in attr.split("."):
            if not hasattr(fn, part):
                raise ValueError(f"rollout.agent={spec!r}: {module_name!r} has no attribute {attr!r}")
            fn = getattr(fn, part)
    else:
        points = {ep.name: ep for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP)}
        if spec not in points:
            known = ", ".join(sorted(points)) or "none"
            raise ValueError(f"rollout.agent={spec!r}: no agent of that name (registered agents: {known}); "
                             f"use 'package.module:function' for an agent that is not registered")
        fn = points[spec].load()
    try:
        check_signature(fn)
    except TypeError as exc:
        raise ValueError(f"rollout.agent={spec!r}: {exc}") from None
    return fn


def as_reward(value: Any, what: str) -> float | None:
    """``value`` as a finite float reward (None stays None); ValueError naming ``what`` and the type otherwise.

    Accepted: any real number (:class:`numbers.Real`: bool, int, float,
    Fraction, NumPy integer and floating scalars), :class:`~decimal.Decimal`,
    and a 0-d array or tensor holding one (NumPy, torch: anything with
    ``ndim == 0`` and ``.item()``). Refused: complex numbers, strings, lists,
    arrays of any other shape, NaN and infinities.
    """
    if value is None:
        return None
    number = value
    # Duck-typed rather than imported: agents of any array library, and no NumPy/torch import here.
    if getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):
        number = value.item()
    if not isinstance(number, numbers.Real | decimal.Decimal):
        raise ValueError(f"{what} must be a real number or None, got {_described(value)}")
    try:
        reward = float(number)
    except (OverflowError, ValueError):  # an int or Fraction beyond float's range, a signalling NaN Decimal
        reward = math.nan
    if not math.isfinite(reward):
        raise ValueError(f"{what} must be finite (and within float's range), got {_short_repr(value)}")
    return reward


def _described(value: Any) -> str:
    """The type of ``value`` with its module (``numpy.ndarray``), and its shape and dtype or a short repr."""
    kind = type(value)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"{name} of shape {tuple(shape)} and dtype {getattr(value, 'dtype', '?')}"
    return f"{name} {_short_repr(value)}"


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# ---------------------------------------------------------------- rewards and annotations


@dataclass
class RolloutScope:
    """The attempt an agent is running, as seen by :func:`emit_reward` (set by the runner)."""

    rollout_id: str
    attempt_id: str
    store: Store
    agent_name: str | None = None
    last_reward: float | None = None
    lease: str | None = None
    """The attempt's lease token: what the store asks of its spans."""


_scope: contextvars.ContextVar[RolloutScope | None] = contextvars.ContextVar("agl_rollout_scope", default=None)


@contextlib.contextmanager
def rollout_scope(scope: RolloutScope) -> Iterator[RolloutScope]:
    """Run the body (an agent) inside ``scope``: its ``emit_*`` calls are recorded for that attempt."""
    token = _scope.set(scope)
    try:
        yield scope
    finally:
        _scope.reset(token)


def _emit(kind: str, reward: float | None, attributes: dict[str, Any]) -> None:
    from agl_core.data import Span

    scope = _scope.get()
    if scope is None:
        raise RuntimeError(f"emit_{kind} was called outside a rollout: call it from the agent function "
                           "(or code it calls in the same thread or task)")
    attributes = {"agent_name": scope.agent_name, **attributes}
    try:
        json.dumps(attributes)  # a store writes spans as JSON, maybe later on another thread: fail here
    except (TypeError, ValueError) as exc:
        raise TypeError(f"emit_{kind}: attributes must be JSON-serializable: {exc}") from None
    now = time.time()
    span = Span(rollout_id=scope.rollout_id, attempt_id=scope.attempt_id, kind=kind, reward=reward,
                sequence_id=scope.store.next_sequence_id(scope.rollout_id), attributes=attributes,
                start_time=now, end_time=now)
    scope.store.add_spans([span], leases={(scope.rollout_id, scope.attempt_id): scope.lease})
    if reward is not None:
        scope.last_reward = reward


def emit_reward(value: float, **attributes: Any) -> None:
    """Record a reward of the current rollout (a ``reward`` span, ordered with its model calls).

    When the agent returns None, the last reward it emitted is the rollout's
    ``final_reward``. Keyword arguments are kept in the span's attributes.
    """
    _emit("reward", as_reward(value, "emit_reward's value"), attributes)


def emit_annotation(**attributes: Any) -> None:
    """Record free-form information with the current rollout's trace (an ``annotation`` span)."""
    _emit("annotation", None, attributes)


def emit_state_key(key: str) -> None:
    """Name the state the agent's next model call is made in (an ``annotation`` span with ``state_key=key``).

    Calls of the same task given the same key are taken to face the same
    situation: step-level estimators (``gigpo``) compare their returns. Call
    it before the model call, with what the agent knows at that point (a
    hash of the observation, the board, the interval still open, ...). The
    last key given before a call is that call's; a call given none has no
    state key. Encode a structured state as text yourself
    (``json.dumps(state, sort_keys=True)``).
    """
    if not isinstance(key, str):
        raise TypeError(f"emit_state_key takes a str, got {type(key).__name__}; encode a structured state as text, "
                        "e.g. json.dumps(state, sort_keys=True)")
    _emit("annotation", None, {STATE_KEY: key})
