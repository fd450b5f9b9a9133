"""The gateway's JSON reading and writing (agl_core.http.recordable.loads/dumps): orjson's speed, the standard
library's results, for the whole class of texts an agent or a policy server may send (drawn with a fixed seed)."""

from __future__ import annotations

import json
import math
import random
import re

import pytest

from agl_core.http.recordable import MAX_REQUEST_DEPTH, dumps, loads
from agl_core.http.rules import RequestError, parse_json_object


def same(a, b) -> bool:
    """Equal values of equal types all the way down (an int is not a float; NaN equals NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def scalar_text(rng: random.Random) -> tuple[str, bool]:
    """A JSON scalar as text (the standard library's extensions included) and whether orjson may read it."""
    kind = rng.randrange(9)
    if kind == 0:  # an integer of any size, beyond 64 bits too (19 digits and more: read by the standard library)
        digits = str(rng.randrange(10 ** rng.randint(1, 40)))
        return rng.choice(["", "-"]) + digits, len(digits) <= 18
    if kind == 1:
        return repr(rng.uniform(-1e6, 1e6)), True
    if kind == 2:
        return rng.choice(["NaN", "Infinity", "-Infinity", "1e400"]), False
    if kind == 3:  # a lone surrogate, escaped
        return json.dumps(f"a{chr(rng.randint(0xD800, 0xDFFF))}b"), False
    if kind == 4:  # a valid pair and characters beyond ASCII
        return json.dumps("ok \U0001f600 日本 \u00e9", ensure_ascii=rng.random() < 0.5), True
    if kind == 5:
        return rng.choice(["true", "false", "null"]), True
    if kind == 6:
        return str(rng.randrange(10 ** 18)), True
    if kind == 7:
        return json.dumps("".join(chr(rng.randint(0, 0x7F)) for _ in range(rng.randint(0, 20)))), True
    return json.dumps(rng.choice(["", "{[", "]}", '"', "\\"])), True


def text_of(rng: random.Random, depth: int = 0) -> tuple[str, bool]:
    if depth > 4 or rng.random() < 0.4:
        return scalar_text(rng)
    parts = [text_of(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    plain = all(p for _, p in parts)
    if rng.random() < 0.5:
        return "[" + ", ".join(t for t, _ in parts) + "]", plain
    keys = [scalar_text(rng) if rng.random() < 0.2 else (json.dumps(f"k{i}"), True) for i in range(len(parts))]
    # A scalar's text as a key: a string, which orjson reads unless it holds 19 digits in a row (then looked at again)
    keys = [(k, p) if k.startswith('"') else (json.dumps(k), not re.search(r"\d{19}", k)) for k, p in keys]
    plain = plain and all(p for _, p in keys)
    return "{" + ", ".join(f"{k}: {t}" for (k, _), (t, _) in zip(keys, parts)) + "}", plain


def test_loads_reads_every_text_as_the_standard_library_does_and_says_when_orjson_could_not():
    rng = random.Random("loads")
    for _ in range(3000):
        text, plain = text_of(rng)
        raw = text.encode("utf-8", "surrogatepass")
        try:
            expected = json.loads(raw)
        except ValueError:
            with pytest.raises(ValueError):
                loads(raw)
            continue
        value, fast = loads(raw)
        assert same(value, expected), text
        assert fast == plain, text  # a long integer, NaN/Infinity or a lone surrogate: the standard library read it


@pytest.mark.parametrize("raw", [b"\xef\xbb\xbf{}", b'{"a": 123456789012345678901234567890}', b'{"a": -Infinity}',
                                 b'{"\\udc80": 1}', b'"\xed\xa0\x80"'])
def test_what_orjson_refuses_or_reads_otherwise_is_the_standard_librarys(raw):
    value, fast = loads(raw)
    assert not fast and same(value, json.loads(raw))


def test_dumps_writes_what_json_dumps_writes_read_back():
    rng = random.Random("dumps")
    for _ in range(3000):
        text, _ = text_of(rng)
        try:
            value = json.loads(text.encode("utf-8", "surrogatepass"))
        except ValueError:
            continue
        for plain in (False, True):
            if plain and not loads(text.encode("utf-8", "surrogatepass"))[1]:
                continue  # plain only for what orjson parsed
            assert same(json.loads(dumps(value, plain)), json.loads(json.dumps(value))), text


def test_a_body_of_many_brackets_but_shallow_passes_and_a_deep_one_is_refused_naming_its_path():
    wide = {"messages": [{"role": "user", "content": "x"}], "metadata": [[] for _ in range(3 * MAX_REQUEST_DEPTH)]}
    assert parse_json_object(json.dumps(wide).encode()) == wide
    deep: list = []
    for _ in range(MAX_REQUEST_DEPTH):
        deep = [deep]
    with pytest.raises(RequestError, match=r"metadata(\[0\])+.*nested 129 levels"):
        parse_json_object(json.dumps({"metadata": deep}).encode())
    with pytest.raises(RequestError, match="lone UTF-16 surrogate U\\+D800"):
        parse_json_object(b'{"messages": [{"content": "hi \\ud800"}]}')
