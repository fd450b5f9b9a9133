"""Wall-clock timing of the step's stages (``timing_s/<stage>``)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def timer(name: str, timing: dict[str, float]) -> Iterator[None]:
    """Add the seconds spent in the block to ``timing[name]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timing[name] = timing.get(name, 0.0) + time.perf_counter() - start
