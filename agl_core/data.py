"""The data model: what agents produce (Task, Span, Rollout, Triplet) and what trainers consume (Batch).

The pydantic models are the records that cross process boundaries (stores,
runners, aggregators). ``Batch`` is the in-memory training batch: a
``TensorDict`` of equal-length tensors, a dict of NumPy columns and a meta
dict, laid out like verl's ``DataProto`` (``batch`` / ``non_tensor_batch`` /
``meta_info``) so that converting between them moves no tensor data.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, GetPydanticSchema, model_validator
from pydantic_core import core_schema

from agl_core.lazy_import import LazyModule

if TYPE_CHECKING:
    import torch
    from tensordict import TensorDict
else:  # imported on first use: the records need neither, and every plugin imports them
    torch = LazyModule("torch", globals())
    tensordict = LazyModule("tensordict", globals())

__all__ = ["CALL_COLUMNS", "OWN_REWARD_SOURCES", "REWARD_FROM_CALL", "REWARD_FROM_JUDGE", "REWARD_FROM_ROLLOUT",
           "REWARD_SOURCE_KEY", "Batch", "LogProbs", "Rollout", "Span", "Task",
           "TokenIds", "Triplet", "state_key_ids"]

# ---------------------------------------------------------------------------- per-call columns
# What a row keeps of the model calls it was made of, for step-level credit (docs/credit-assignment.md).
# ``turn_ids`` is a tensor of the responses' shape (int32): on each token a call generated, that call's position in
# its rollout's trace (the ``turn_index`` of a row that starts with it); -1 on every other token (context between
# calls, padding), so two calls with no token between them stay apart. The ``call_*`` columns are NumPy
# ``(rows, C)`` arrays, C the most calls of one row in the batch (1 for one row per call); a row's calls fill its
# first columns in call order, padding the rest:
#   call_turns           int64   each call's position in its trace (its tokens' turn_ids); -1 on padding
#   call_rewards         float64 the call's own reward (the reward spans that follow it) when it has one, else its
#                                rollout's reward; NaN on padding
#   call_reward_sources  str     where call_rewards comes from: REWARD_FROM_CALL (the agent's reward spans),
#                                REWARD_FROM_JUDGE (a judge's: a reward span whose attributes[REWARD_SOURCE_KEY] is
#                                REWARD_FROM_JUDGE) or REWARD_FROM_ROLLOUT; "" on padding. The first two are the
#                                call's own reward (OWN_REWARD_SOURCES)
#   call_state_keys      object  the state key the agent gave the call (agl_core.emit_state_key), or None
#   call_state_ids       int64   the state key as an integer (state_key_ids), -1 without a key and on padding: what
#                                the estimators group calls by, without touching a Python string per call
CALL_COLUMNS = ("call_turns", "call_rewards", "call_reward_sources", "call_state_keys", "call_state_ids")
REWARD_FROM_CALL = "call"
REWARD_FROM_JUDGE = "judge"
REWARD_FROM_ROLLOUT = "rollout"
OWN_REWARD_SOURCES = (REWARD_FROM_CALL, REWARD_FROM_JUDGE)
REWARD_SOURCE_KEY = "reward_source"  # the attribute of a reward span that names who gave it (absent: the agent)
REWARD_SOURCE_DTYPE = np.dtype("<U7")


def state_key_ids(keys: Iterable[str | None]) -> np.ndarray:
    """The ``call_state_ids`` of state keys (int64): a 63-bit BLAKE2b digest of each key's UTF-8 text, -1 for None.

    A digest, not a number given out per batch, so that the same key has the
    same id in every batch, process and run: rows built apart (Ray workers,
    several policies' rows concatenated, a resumed run) group alike. Two
    distinct keys share an id with probability about n^2 / 2^64 for n
    distinct keys (n = 10^6: 5e-8). Each distinct key is hashed once.
    """
    ids: dict[str | None, int] = {None: -1}

    def digest(key: str) -> int:
        return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1

    return np.fromiter((ids[key] if key in ids else ids.setdefault(key, digest(key)) for key in keys),
                       dtype=np.int64)


# ---------------------------------------------------------------------------- records


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _check_logprobs(response_ids: list[int], logprobs: list[float] | None) -> None:
    if logprobs is not None and len(logprobs) != len(response_ids):
        raise ValueError(f"response_logprobs has {len(logprobs)} entries for {len(response_ids)} response tokens")


class Task(_Record):
    """One unit of work handed to an agent."""

    id: str = Field(description="Unique id of the task within its dataset.")
    input: dict[str, Any] = Field(description="Free-form payload the agent receives (question, environment seed, ...).")
    split: str = Field("train", description="Dataset split the task belongs to, e.g. 'train' or 'val'.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Anything else (source, difficulty, ...).")


class _Packed(Sequence):
    """An immutable sequence of numbers packed in one ``bytes`` buffer, that behaves like the list it replaces.

    Equal to a list (or another packed sequence of its kind) with the same
    items; indexing gives Python numbers, slicing a packed sequence;
    ``packed + list`` and ``list + packed`` give a list, two packed sequences
    concatenate packed. ``packed`` is the raw buffer (native byte order) and
    ``array`` a read-only NumPy view of it: comparing, joining and copying
    them runs at memory speed, with no Python object per item.
    """

    __slots__ = ("packed",)
    _typecode: ClassVar[str]  # array module type code of an item
    _dtype: ClassVar[np.dtype]
    itemsize: ClassVar[int]  # bytes per item in ``packed``

    def __init__(self, items: Iterable = ()):
        if isinstance(items, type(self)):
            packed = items.packed
        elif isinstance(items, np.ndarray):
            if items.ndim != 1:
                raise ValueError(f"{type(self).__name__} takes a 1-D array, not {items.ndim}-D")
            packed = items.astype(self._dtype, casting="same_kind", copy=False).tobytes()
        else:
            packed = array(self._typecode, items).tobytes()
        object.__setattr__(self, "packed", packed)

    @classmethod
    def frombytes(cls, packed: bytes):
        """The sequence whose raw buffer is ``packed`` (``len(packed)`` a multiple of the item size)."""
        if len(packed) % cls._dtype.itemsize:
            raise ValueError(f"{len(packed)} bytes are not a whole number of {cls._dtype.itemsize}-byte items")
        self = object.__new__(cls)
        object.__setattr__(self, "packed", bytes(packed))
        return self

    @property
    def array(self) -> np.ndarray:
        """A read-only NumPy view of the items (no copy)."""
        return np.frombuffer(self.packed, dtype=self._dtype)

    def tolist(self) -> list:
        return memoryview(self.packed).cast(self._typecode).tolist()

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __len__(self) -> int:
        return len(self.packed) // self.itemsize

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step == 1:
                size = self._dtype.itemsize
                return type(self).frombytes(self.packed[start * size: max(start, stop) * size])
            return type(self)(self.array[index])
        return self.array[index].item()

    def __iter__(self):
        return iter(self.tolist())

    def __eq__(self, other):
        if isinstance(other, type(self)):
            return self.packed == other.packed
        if isinstance(other, list):
            return len(other) == len(self) and self.tolist() == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.packed)

    def __add__(self, other):
        if isinstance(other, type(self)):
            return type(self).frombytes(self.packed + other.packed)
        if isinstance(other, list):
            return self.tolist() + other
        return NotImplemented

    def __radd__(self, other):
        if isinstance(other, list):
            return other + self.tolist()
        return NotImplemented

    def __array__(self, dtype=None, copy=None):
        view = self.array
        return view.copy() if copy else view if dtype is None else view.astype(dtype)

    def __reduce__(self):
        return type(self).frombytes, (self.packed,)

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.tolist()!r})"


class TokenIds(_Packed):
    """Token ids packed as int64, 8 bytes each (a list of ints costs about 40 bytes per id)."""

    __slots__ = ()
    _typecode, _dtype, itemsize = "q", np.dtype(np.int64), 8


class LogProbs(_Packed):
    """Log-probs packed as float64, 8 bytes each: the same values as the list of floats they come from."""

    __slots__ = ()
    _typecode, _dtype, itemsize = "d", np.dtype(np.float64), 8


def _packed_field(cls: type[_Packed], item_schema: core_schema.CoreSchema) -> Any:
    """A pydantic field type: validated as a list of ``item_schema`` (JSON included), held as ``cls``, dumped as a
    list. From JSON, the list is parsed in pydantic's core and packed once; from Python, a ``cls`` is kept as it
    is, and a list of plain numbers or a 1-D NumPy array of a compatible dtype is packed directly."""
    as_list = core_schema.list_schema(item_schema)

    def pack(items: list) -> _Packed:
        try:
            return cls(items)
        except OverflowError as e:  # a ValueError becomes a ValidationError
            raise ValueError(f"{cls.__name__} holds 64-bit items: {e}") from None

    def validate(value: Any, handler: Any) -> _Packed:
        if isinstance(value, cls):
            return value
        if type(value) is list:
            try:  # plain ints (floats): packed directly, as pydantic would validate them
                return cls.frombytes(array(cls._typecode, value).tobytes())
            except (TypeError, OverflowError):
                pass  # anything else (numeric strings, ...) goes through pydantic's list validation
        if isinstance(value, np.ndarray) and np.can_cast(value.dtype, cls._dtype, "same_kind") and value.ndim == 1:
            return cls(value)
        return pack(handler(value))

    def dump(value: Any) -> list:
        return value.tolist() if isinstance(value, _Packed) else value

    schema = core_schema.json_or_python_schema(
        json_schema=core_schema.no_info_after_validator_function(pack, as_list),
        python_schema=core_schema.no_info_wrap_validator_function(validate, as_list),
        serialization=core_schema.plain_serializer_function_ser_schema(dump, return_schema=as_list))

    return Annotated[list, GetPydanticSchema(lambda _source, _handler: schema,
                                             lambda _schema, handler: handler(as_list))]


_TokenIdsField = _packed_field(TokenIds, core_schema.int_schema())
_LogProbsField = _packed_field(LogProbs, core_schema.float_schema())


class Span(_Record):
    """One recorded event of a rollout: a model call (with its exact token ids), a reward, or an annotation.

    Token ids and log-probs are held packed (:class:`TokenIds`, :class:`LogProbs`):
    they compare equal to lists, serialize as lists, and accept lists.
    """

    rollout_id: str = Field(description="Rollout this span belongs to.")
    attempt_id: str = Field("0", description="Attempt of the rollout (a retried rollout gets a new attempt).")
    sequence_id: int = Field(description="Order of the span within its rollout.")
    kind: Literal["llm_call", "reward", "annotation"] = Field(description="What the span records.")
    prompt_token_ids: _TokenIdsField = Field(default_factory=TokenIds,
                                             description="Prompt token ids as the engine saw them.")
    response_token_ids: _TokenIdsField = Field(default_factory=TokenIds, description="Sampled token ids as returned.")
    response_logprobs: _LogProbsField | None = Field(
        None, description="Log-prob of each response token, when returned.")
    reward: float | None = Field(None, description="Reward carried by a 'reward' span.")
    attributes: dict[str, Any] = Field(default_factory=dict, description="Free-form: agent name, tool, ...")
    start_time: float | None = Field(None, description="Start, seconds since the epoch.")
    end_time: float | None = Field(None, description="End, seconds since the epoch.")

    @model_validator(mode="after")
    def _logprobs_match_response(self) -> Span:
        # Also runs when a Rollout takes Span instances: packed buffers of equal size are checked without len().
        response, logprobs = self.response_token_ids, self.response_logprobs
        if logprobs is not None and not (type(response) is TokenIds and type(logprobs) is LogProbs
                                         and len(response.packed) == len(logprobs.packed)):
            _check_logprobs(response, logprobs)
        return self


class Triplet(_Record):
    """(prompt, response, reward) of one model call: the unit a trace aggregator turns into a batch row."""

    prompt_ids: list[int] = Field(description="Prompt token ids.")
    response_ids: list[int] = Field(description="Response token ids.")
    response_logprobs: list[float] | None = Field(None, description="Log-prob of each response token, when known.")
    reward: float | None = Field(None, description="Reward attributed to this call, if any.")
    rollout_id: str = Field(description="Rollout the call belongs to.")
    turn_index: int = Field(description="Position of the call within its rollout (0-based).")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Extra context: agent name, span id, ...")

    @model_validator(mode="after")
    def _logprobs_match_response(self) -> Triplet:
        _check_logprobs(self.response_ids, self.response_logprobs)
        return self


class Rollout(_Record):
    """One run of an agent on a task, with what it recorded."""

    rollout_id: str = Field(description="Unique id of the rollout.")
    task_id: str = Field(description="Task the rollout ran.")
    sample_index: int = Field(0, description="Which of the rollout.n samples of its task this is.")
    status: Literal["queuing", "running", "succeeded", "failed", "timed_out"] = Field(description="Lifecycle state.")
    final_reward: float | None = Field(None, description="Reward of the whole rollout, when known.")
    spans: list[Span] = Field(default_factory=list, description="Recorded spans, in any order (see Span.sequence_id).")
    triplets: list[Triplet] = Field(default_factory=list, description="Triplets, when the producer already has them.")
    error: str | None = Field(None, description="Why the rollout failed or timed out.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Free-form metadata.")
    attempt_id: str | None = Field(None, description="Attempt whose spans these are (the last one run).")
    attempts: int = Field(0, ge=0, description="Attempts started: 1, plus one per requeue after a lost lease.")
    start_time: float | None = Field(None, description="Start of the last attempt, seconds since the epoch.")
    end_time: float | None = Field(None, description="End of the rollout, seconds since the epoch.")


# ---------------------------------------------------------------------------- Batch


def _tensordict(columns: dict[str, torch.Tensor], n: int, device: torch.device | None) -> TensorDict:
    # The columns are validated by the caller; _new_unsafe skips TensorDict's
    # per-key re-validation (about 18 us -> 1 us for 12 columns), which matters
    # because the loop derives several batches per step.
    return tensordict.TensorDict._new_unsafe(columns, batch_size=torch.Size([n]), device=device)


def _as_column_array(name: str, value: Any) -> np.ndarray:
    """A non-tensor column as a NumPy array with one entry per row (lists become 1-D object arrays)."""
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            raise ValueError(f"column {name!r} is a scalar; columns need a first (row) dimension")
        return value
    if isinstance(value, list | tuple):
        # fromiter keeps each element as one object, even when elements are equal-length lists.
        return np.fromiter(value, dtype=object, count=len(value))
    raise TypeError(f"column {name!r}: expected a torch.Tensor, np.ndarray or list, got {type(value).__name__}")


def _row_indices(index: Any, n: int) -> np.ndarray:
    """Any supported row index (int, slice, int/bool list, array or tensor) as non-negative int64 row numbers."""
    if isinstance(index, int | np.integer) and not isinstance(index, bool):
        rows = np.array([index], dtype=np.int64)
    elif isinstance(index, slice):
        rows = np.arange(*index.indices(n))
    elif isinstance(index, torch.Tensor):
        rows = index.detach().cpu().numpy()
    elif isinstance(index, np.ndarray):
        rows = index
    elif isinstance(index, list | tuple):
        rows = np.asarray(index) if len(index) else np.empty(0, dtype=np.int64)
    else:
        raise TypeError(f"cannot select rows with a {type(index).__name__}; use an int, slice, list, array or tensor")
    if rows.ndim != 1:
        raise IndexError(f"a row index must be 1-D, got shape {tuple(rows.shape)}")
    if rows.dtype == np.bool_:
        if rows.shape[0] != n:
            raise IndexError(f"boolean mask has length {rows.shape[0]}, the batch has {n} rows")
        return np.flatnonzero(rows)
    if not np.issubdtype(rows.dtype, np.integer):
        raise TypeError(f"row indices must be integers or booleans, got dtype {rows.dtype}")
    rows = rows.astype(np.int64, copy=False)
    if rows.size:
        low, high = int(rows.min()), int(rows.max())
        if low < -n or high >= n:
            raise IndexError(f"row index {low if low < -n else high} is out of range for a batch of {n} rows")
        if low < 0:
            rows = np.where(rows < 0, rows + n, rows)
    return rows


def _equal(a: Any, b: Any) -> bool:
    """Equality for conflict checks, as verl's union/concat: tensors with ``torch.equal``, NaN equals NaN elsewhere."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.dtype == object:
            return all(_equal(x, y) for x, y in zip(a.flat, b.flat))
        return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)


def _merge_meta(metas: Iterable[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for meta in metas:
        for key, value in meta.items():
            if key in merged and not _equal(merged[key], value):
                raise ValueError(f"meta key {key!r} has different values in the batches being combined")
            merged[key] = value
    return merged


class Batch:
    """Training rows: ``tensors`` (TensorDict, batch_size ``[N]``), ``non_tensors`` (NumPy, length N), ``meta``.

    Every column has N rows along its first dimension. ``batch["name"]``
    reads a column and ``batch["name"] = value`` writes one with the length
    checked (tensors go to ``tensors``, arrays and lists to ``non_tensors``);
    any other index selects rows. A batch without columns takes its length
    from the first column written. Writing ``batch.non_tensors`` directly
    skips the length check.

    Operations that select rows return a new Batch whose ``meta`` is a
    shallow copy; slices share memory with the source (views). Other
    selections are lazy: the new batch records the row index and gathers a
    tensor column the first time it is read (``batch["x"]``, ``tensors``), so
    a chain of selections costs one copy per column that is actually used,
    and none for a column nobody reads. Until then it keeps the source
    tensors alive and sees in-place writes to them.
    """

    __slots__ = ("_pending", "_td", "meta", "non_tensors")

    def __init__(
        self,
        tensors: dict[str, torch.Tensor] | TensorDict | None = None,
        non_tensors: dict[str, np.ndarray | list] | None = None,
        meta: dict[str, Any] | None = None,
    ) -> None:
        device = None
        n = 0
        if isinstance(tensors, tensordict.TensorDict):
            device = tensors.device
            n = tensors.batch_size[0] if len(tensors.batch_size) else 0
        columns = dict(tensors.items()) if tensors is not None else {}
        arrays = {name: _as_column_array(name, value) for name, value in (non_tensors or {}).items()}
        both = columns.keys() & arrays.keys()
        if both:
            raise ValueError(f"columns {sorted(both)} are given both as tensors and as non-tensors")
        for name, value in columns.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"tensor column {name!r} must be a torch.Tensor, got {type(value).__name__}")
            if value.ndim == 0:
                raise ValueError(f"column {name!r} is a scalar; columns need a first (row) dimension")
        first: str | None = None
        for name, value in [*columns.items(), *arrays.items()]:
            if first is None:
                first, n = name, value.shape[0]
            elif value.shape[0] != n:
                raise ValueError(f"column {name!r} has length {value.shape[0]}, but column {first!r} has length {n}")
        self._td = _tensordict(columns, n, device)
        self._pending: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.non_tensors = arrays
        self.meta = dict(meta or {})

    @classmethod
    def empty(cls) -> Batch:
        """A batch with no rows and no columns."""
        return cls()

    def _derive(self, columns: dict[str, torch.Tensor], arrays: dict[str, np.ndarray], n: int,
                meta: dict[str, Any] | None = None,
                pending: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> Batch:
        # Internal constructor for already-consistent columns: no validation, no copies.
        out = type(self).__new__(type(self))
        out._td = _tensordict(columns, n, self._td.device)
        out._pending = pending or {}
        out.non_tensors = arrays
        out.meta = dict(self.meta) if meta is None else meta
        return out

    @property
    def tensors(self) -> TensorDict:
        """The tensor columns (TensorDict, batch_size ``[N]``); gathers every column still pending."""
        for name in list(self._pending):
            self._gather(name)
        return self._td

    def _gather(self, name: str) -> torch.Tensor:
        source, rows = self._pending.pop(name)
        value = source.index_select(0, rows.to(source.device))
        self._td[name] = value
        return value

    def pop(self, name: str) -> torch.Tensor | np.ndarray:
        """Remove column ``name`` and return it."""
        if name in self.non_tensors:
            return self.non_tensors.pop(name)
        if name in self._pending:
            value = self._gather(name)
        else:
            value = self[name]
        del self._td[name]
        return value

    # ------------------------------------------------------------ columns

    def __len__(self) -> int:
        return self._td.batch_size[0]

    def keys(self) -> list[str]:
        """Column names: tensor columns first, then non-tensor columns."""
        return [*self._td.keys(), *self._pending, *self.non_tensors]

    def __contains__(self, name: object) -> bool:
        return name in self.non_tensors or name in self._pending or name in self._td.keys()

    def __getitem__(self, key: Any) -> Any:
        """``batch["col"]``: the column (tensor or array). Anything else: ``select(key)``."""
        if not isinstance(key, str):
            return self.select(key)
        if key in self.non_tensors:
            return self.non_tensors[key]
        if key in self._pending:
            return self._gather(key)
        value = self._td.get(key, None)
        if value is None:
            raise KeyError(f"no column {key!r}; the batch has {self.keys()}")
        return value

    def __setitem__(self, name: str, value: torch.Tensor | np.ndarray | list) -> None:
        """Set a column; tensors go to ``tensors``, arrays and lists to ``non_tensors`` (replacing either)."""
        if not isinstance(name, str):
            raise TypeError(f"column names are str, got {type(name).__name__}; rows cannot be assigned")
        is_tensor = isinstance(value, torch.Tensor)
        if not is_tensor:
            value = _as_column_array(name, value)
        elif value.ndim == 0:
            raise ValueError(f"column {name!r} is a scalar; columns need a first (row) dimension")
        others = [key for key in self.keys() if key != name]
        if not others:
            # No other column pins the length: this one defines it.
            self._td = _tensordict({}, value.shape[0], self._td.device)
        elif value.shape[0] != len(self):
            raise ValueError(f"column {name!r} has length {value.shape[0]}, but the batch has {len(self)} rows")
        self._pending.pop(name, None)
        if is_tensor:
            self.non_tensors.pop(name, None)
            self._td[name] = value
        else:
            if name in self._td.keys():
                del self._td[name]
            self.non_tensors[name] = value

    def __repr__(self) -> str:
        tensors = {k: f"{tuple(v.shape)} {v.dtype}" for k, v in self._td.items()}
        tensors.update({k: f"{(len(self), *v.shape[1:])} {v.dtype} (pending)" for k, (v, _) in self._pending.items()})
        return (f"Batch(len={len(self)}, tensors={tensors}, non_tensors={list(self.non_tensors)}, "
                f"meta={list(self.meta)})")

    # ------------------------------------------------------------ rows

    def select(self, index: int | slice | Sequence[int] | Sequence[bool] | np.ndarray | torch.Tensor) -> Batch:
        """Rows picked by ``index`` (int, slice, int list/array/tensor, or bool mask), in that order.

        A slice with a positive step returns views. Any other index is lazy:
        each tensor column is gathered (one ``index_select``, several times
        faster than advanced indexing on CPU) when it is first read.
        Negative indices count from the end.
        """
        if isinstance(index, slice) and (index.step is None or index.step > 0):
            return self._derive({k: v[index] for k, v in self._td.items()},
                                {k: v[index] for k, v in self.non_tensors.items()},
                                len(range(*index.indices(len(self)))),
                                pending={k: (src, rows[index]) for k, (src, rows) in self._pending.items()})
        rows = torch.from_numpy(_row_indices(index, len(self)))
        pending = {name: (value, rows) for name, value in self._td.items()}
        composed: dict[int, torch.Tensor] = {}  # columns selected together share one composed index
        for name, (source, source_rows) in self._pending.items():
            if id(source_rows) not in composed:
                composed[id(source_rows)] = source_rows[rows]
            pending[name] = (source, composed[id(source_rows)])
        arrays = {k: v[rows.numpy()] for k, v in self.non_tensors.items()}
        return self._derive({}, arrays, rows.shape[0], pending=pending)

    def reorder(self, indices: Sequence[int] | np.ndarray | torch.Tensor) -> Batch:
        """The batch with its rows permuted: row ``i`` of the result is row ``indices[i]``.

        ``indices`` must be a permutation of ``range(len(self))``. Unlike verl's
        in-place ``DataProto.reorder``, this returns a new Batch.
        """
        rows = _row_indices(indices, len(self))
        if rows.shape[0] != len(self) or not np.array_equal(np.sort(rows), np.arange(len(self))):
            raise ValueError(f"reorder needs a permutation of range({len(self)}), got {rows.shape[0]} indices "
                             "with repeats or gaps")
        return self.select(rows)

    @classmethod
    def concat(cls, batches: Sequence[Batch]) -> Batch:
        """The rows of ``batches`` one after the other (as verl's ``DataProto.concat``).

        All batches must have the same columns. ``meta`` is merged; a key
        with different values in two batches is an error.
        """
        if not batches:
            raise ValueError("Batch.concat needs at least one batch")
        first = batches[0]
        tensor_keys, array_keys = set(first.tensors.keys()), set(first.non_tensors)
        for i, batch in enumerate(batches[1:], start=1):
            if set(batch.tensors.keys()) != tensor_keys or set(batch.non_tensors) != array_keys:
                mine, theirs = set(first.keys()), set(batch.keys())
                raise ValueError(
                    f"Batch.concat: batch {i} has different columns than batch 0 "
                    f"(missing {sorted(mine - theirs)}, extra {sorted(theirs - mine)}, "
                    f"or a column that is a tensor in one and not in the other)")
        parts = [dict(batch.tensors.items()) for batch in batches]
        columns = {name: torch.cat([part[name] for part in parts]) for name in first.tensors.keys()}
        arrays = {name: np.concatenate([b.non_tensors[name] for b in batches]) for name in first.non_tensors}
        meta = _merge_meta(batch.meta for batch in batches)
        return first._derive(columns, arrays, sum(len(batch) for batch in batches), meta)

    def chunk(self, n: int) -> list[Batch]:
        """Split into ``n`` equal contiguous chunks (views), as verl's ``DataProto.chunk`` without auto-padding."""
        if n < 1:
            raise ValueError(f"chunk count must be >= 1, got {n}")
        if len(self) % n:
            raise ValueError(f"cannot split a batch of {len(self)} rows into {n} equal chunks "
                             f"({len(self)} % {n} = {len(self) % n}); pad_to_divisor({n}) first")
        size = len(self) // n
        return [self.select(slice(i * size, (i + 1) * size)) for i in range(n)]

    def pad_to_divisor(self, k: int) -> tuple[Batch, int]:
        """``(padded, pad_size)`` with ``len(padded) % k == 0``, as verl's ``pad_dataproto_to_divisor``.

        The ``pad_size`` appended rows repeat the batch from its first row
        (wrapping around when ``pad_size > len``). ``pad_size`` is 0 when the
        length is already a multiple of ``k`` (an empty batch included), and
        the batch is then returned itself, as verl does.
        """
        if k < 1:
            raise ValueError(f"divisor must be >= 1, got {k}")
        pad_size = -len(self) % k
        if pad_size == 0:
            return self, 0
        return self.select(np.arange(len(self) + pad_size) % len(self)), pad_size

    def unpad(self, pad_size: int) -> Batch:
        """Drop the last ``pad_size`` rows (view), undoing ``pad_to_divisor``; verl's ``unpad_dataproto``
        (which returns the batch itself when ``pad_size`` is 0)."""
        if not 0 <= pad_size <= len(self):
            raise ValueError(f"pad_size must be in [0, {len(self)}], got {pad_size}")
        return self if pad_size == 0 else self.select(slice(0, len(self) - pad_size))

    def union(self, other: Batch) -> Batch:
        """Columns and meta of both batches (as verl's ``DataProto.union``, but returning a new Batch).

        A column or meta key present in both must hold equal values; a
        different value, or a length mismatch, is an error.
        """
        if self.keys() and other.keys() and len(self) != len(other):
            raise ValueError(f"union of batches with {len(self)} and {len(other)} rows")
        columns, arrays = dict(self.tensors.items()), dict(self.non_tensors)
        for name, value in [*other.tensors.items(), *other.non_tensors.items()]:
            mine = columns.get(name, arrays.get(name))
            if mine is not None and not _equal(mine, value):
                raise ValueError(f"union: column {name!r} differs between the two batches")
            (columns if isinstance(value, torch.Tensor) else arrays)[name] = value
        n = len(self) if self.keys() else len(other)
        return self._derive(columns, arrays, n, _merge_meta([self.meta, other.meta]))

    # ------------------------------------------------------------ verl

    def to_dataproto(self) -> Any:
        """This batch as a ``verl.DataProto`` sharing every tensor and array (no copy).

        The DataProto gets its own TensorDict and dicts, so verl's in-place
        operations (``union``, ``pop``, ``reorder``) do not change this batch.
        """
        data_proto = _dataproto_class()
        return data_proto(batch=_tensordict(dict(self.tensors.items()), len(self), self.tensors.device),
                          non_tensor_batch=dict(self.non_tensors), meta_info=dict(self.meta))

    @classmethod
    def from_dataproto(cls, data: Any) -> Batch:
        """A Batch sharing the tensors and arrays of a ``verl.DataProto`` (no copy)."""
        return cls(tensors=data.batch, non_tensors=data.non_tensor_batch, meta=data.meta_info)


def _dataproto_class() -> type:
    try:
        from verl import DataProto
    except ImportError as exc:
        raise ImportError("converting a Batch to or from verl's DataProto needs verl: "
                          "pip install 'agl-core[verl]'") from exc
    return DataProto
