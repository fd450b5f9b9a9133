"""What a request or a span may hold: JSON that every later reader reads back as it was written.

Two kinds of JSON text parse in Python but are not recorded faithfully
further on (see ``/docs/reliability.md``):

- **Deep nesting.** pydantic's JSON reader (every store's read of a span)
  stops at 200 levels and its writer fails a little deeper; Python's own
  parser at about 1,000. A request body may nest at most
  :data:`MAX_REQUEST_DEPTH` levels, a span (which holds the request a few
  levels down) :data:`MAX_SPAN_DEPTH`, both well below what every reader
  takes.
- **Lone UTF-16 surrogates** (``"\\ud800"``: valid JSON escapes, no valid
  Unicode, what a file name read with ``surrogateescape`` becomes): UTF-8
  cannot encode them, so no store can write them. They are refused, in keys
  and in values, never replaced: what is recorded is what the agent sent.

The checks run where a value comes in (the gateway's door, a store's
``add_spans``, the store service's request), so a value that cannot be
recorded fails its own call with a 400 naming its path, never a writer
thread, another call or the run.
"""

from __future__ import annotations

import json
import re
from typing import Any, Protocol

import orjson

MAX_REQUEST_DEPTH = 128
"""The deepest nesting a request body may have (the body itself is level 1)."""
MAX_SPAN_DEPTH = 160
"""The deepest nesting a span's JSON may have (the span object is level 1): a request at the limit, held a few levels
down in the span's attributes, fits, and a rollout read back with its spans stays below pydantic's 200."""
_SHOWN = 8
"""Path components shown at each end of a long path."""


class NotRecordable(ValueError):
    """A value that cannot be recorded faithfully; ``path`` names where it is (``messages[0].content``)."""

    def __init__(self, message: str, path: str):
        super().__init__(message)
        self.path = path


def check_json(value: Any, max_depth: int, where: str = "") -> None:
    """NotRecordable naming the path (from ``where``) of the first key or string of ``value`` (parsed JSON) that
    holds a lone surrogate, or of the first value nested deeper than ``max_depth`` levels."""
    _check(value, max_depth, 1, [where] if where else [])


def loads(raw: bytes) -> tuple[Any, bool]:
    """The JSON text ``raw`` parsed exactly as ``json.loads`` parses it, and whether orjson parsed it.

    orjson parses several times faster, and what it parses holds no lone
    surrogate (it refuses them), no ``NaN``/``Infinity`` (not JSON) and no
    integer beyond 64 bits: what it parses, :func:`dumps` writes back as it
    came. orjson reads an integer beyond 64 bits as a float, so a text with 19
    digits in a row goes to the standard library, as does every text orjson
    refuses: the standard library's result (or error) is the one that counts.
    """
    if _LONG_DIGITS not in raw.translate(_DIGITS_ONLY):
        try:
            return orjson.loads(raw), True
        except orjson.JSONDecodeError:
            pass
    return json.loads(raw), False


def dumps(value: Any, plain: bool = False) -> bytes:
    """``value`` as JSON that ``json.loads`` reads back as ``json.dumps(value)`` does, written by orjson where that
    holds (compact, UTF-8): always when ``plain`` (``value`` is made of what :func:`loads` parsed with orjson, ints,
    finite floats, str, lists and dicts), else when orjson wrote no ``null`` (it writes NaN and Infinity as null).
    Anything else (an integer beyond 64 bits, a lone surrogate) as the standard library writes it."""
    try:
        out = orjson.dumps(value)
    except TypeError:
        return json.dumps(value).encode()
    return out if plain or b"null" not in out else json.dumps(value).encode()


def within_depth(raw: bytes, max_depth: int) -> bool:
    """Whether the JSON text ``raw`` surely nests at most ``max_depth`` levels: it holds at most that many brackets
    (a value is nested no deeper than the brackets that open before it, strings' included). False says "look"."""
    return raw.count(b"{") + raw.count(b"[") <= max_depth


_DIGITS_ONLY = bytes(48 if byte in b"0123456789" else 32 for byte in range(256))
"""A translation table: every digit to ``0``, every other byte to a space (a digit run then reads as zeros)."""
_LONG_DIGITS = b"0" * 19


def deep_path(raw: str, max_depth: int) -> str | None:
    """The path of the first value of the JSON text ``raw`` nested deeper than ``max_depth`` levels, or None.

    For a text too deep for Python's parser to hand over at all (about 1,000
    levels): the path of what no parser here could read, found by following
    its brackets, keys and commas, strings skipped whole.
    """
    path: list = []
    expecting_key = False
    for token in _TOKENS.finditer(raw):
        text = token.group()
        if text in "{[":
            if len(path) >= max_depth:
                return _path(path)
            path.append(None if text == "{" else 0)
            expecting_key = text == "{"
        elif text in "}]":
            if path:
                path.pop()
        elif text == ",":
            if path and isinstance(path[-1], int):
                path[-1] += 1
            else:
                expecting_key = True
        elif text != ":" and expecting_key and path:
            path[-1] = json.loads(text)
            expecting_key = False
    return None


_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[{}\[\],:]')


class _SpanFields(Protocol):
    """What :func:`check_span` reads of an :class:`agl_core.data.Span` (named here so that this module, which the
    HTTP rules use, stands below the data model)."""

    kind: str
    attributes: dict[str, Any]
    sequence_id: int
    rollout_id: str
    attempt_id: str


def check_span(span: _SpanFields) -> None:
    """NotRecordable naming the span (rollout, attempt, sequence id) and the path of what it cannot hold."""
    try:
        # A span's own fields are typed (ids, numbers, token lists); only its free-form JSON needs a look.
        _check_text(span.kind, ["kind"])
        _check(span.attributes, MAX_SPAN_DEPTH, 2, ["attributes"])
    except NotRecordable as exc:
        raise NotRecordable(f"span {span.sequence_id} of rollout {span.rollout_id!r} attempt {span.attempt_id!r}: "
                            f"{exc}", exc.path) from None


def _check(value: Any, max_depth: int, depth: int, path: list[str]) -> None:
    if isinstance(value, str):
        _check_text(value, path)
    elif isinstance(value, dict | list):
        if depth > max_depth:
            where = _path(path)
            raise NotRecordable(f"{where!r} is nested {depth} levels deep; at most {max_depth} are accepted", where)
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, path, key=True)
                path.append(key)
                _check(item, max_depth, depth + 1, path)
                path.pop()
        else:
            for index, item in enumerate(value):
                path.append(index)
                _check(item, max_depth, depth + 1, path)
                path.pop()


def _check_text(text: Any, path: list, key: bool = False) -> None:
    if not isinstance(text, str) or text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        where = _path([*path, text] if key else path)
        what = f"the key {text!r} in {_path(path)!r}" if key else repr(where)
        raise NotRecordable(f"{what} holds a lone UTF-16 surrogate U+{code:04X} at character {exc.start}: "
                            f"not Unicode, so it cannot be recorded (send valid UTF-8 text)", where) from None


def _path(path: list) -> str:
    """``a.b[3].c``; a long path keeps its first and last :data:`_SHOWN` components."""
    parts = path if len(path) <= 2 * _SHOWN else [*path[:_SHOWN], "…", *path[-_SHOWN:]]
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part == "…" and parts is not path:
            out += ".…"
        else:  # a key shown as it is, but for code points UTF-8 cannot write (the message must be writable)
            text = part.encode("utf-8", "backslashreplace").decode("utf-8")
            out += f".{text}" if out else text
    return out or "body"
