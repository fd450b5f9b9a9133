"""Output tensors paged in ahead of time on a helper thread, while an aggregator walks the rollouts.

Most of the time it takes to build a large batch is the kernel mapping fresh
pages for the output tensors (hundreds of MB), and the walk over the rollouts
that comes first is Python on one core. A :class:`Reservation` allocates the
tensors for an estimated number of rows and asks the kernel to map their
pages (``madvise(MADV_POPULATE_WRITE)``, Linux 5.14+) from a helper thread,
one system call per tensor: the call releases the GIL, runs on the helper's
core only, and maps the pages without the per-page faults of writing them.
Whatever is mapped by the time the tensors are claimed costs nothing later;
the rest faults in as the tensors are written, as it would have without a
reservation. Where the call is not available, nothing is paged in ahead.
The tensors' content is undefined, as ``torch.empty``'s.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import threading

import torch

_MADV_POPULATE_WRITE = 23  # <linux/mman.h>


def _madvise():
    """libc's ``madvise`` (releasing the GIL while it runs), or None where there is no such libc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    function = ctypes.CDLL(name, use_errno=True).madvise
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return function


_MADVISE = _madvise()


def populate(tensor: torch.Tensor) -> bool:
    """Map every whole page of ``tensor``'s memory now; False where the kernel cannot (nothing changes)."""
    if _MADVISE is None:
        return False
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
    return last <= first or _MADVISE(first, last - first, _MADV_POPULATE_WRITE) == 0


class Reservation:
    """Uninitialised tensors of ``capacity`` rows, ``name -> (width, dtype)``, paged in on a helper thread."""

    def __init__(self, columns: dict[str, tuple[int, torch.dtype]], capacity: int):
        self._tensors = {name: torch.empty((capacity, width), dtype=dtype) for name, (width, dtype) in columns.items()}
        self._stop = threading.Event()
        self._helper = threading.Thread(target=self._populate, args=(list(self._tensors.values()),),
                                        name="agl-traces-reserve", daemon=True)
        self._helper.start()

    def _populate(self, tensors: list[torch.Tensor]) -> None:
        for tensor in tensors:
            if self._stop.is_set() or not populate(tensor):
                return

    def claim(self, n: int) -> dict[str, torch.Tensor] | None:
        """The tensors' first ``n`` rows; None when ``n`` rows do not fit, or fill less than half of them (views
        would keep the rest mapped as long as the batch lives): the caller allocates then.

        The helper is told to stop, not waited for: a tensor it is still
        mapping can be written meanwhile.
        """
        self._stop.set()
        tensors, self._tensors = self._tensors, {}
        capacity = len(next(iter(tensors.values())))
        if n > capacity or 2 * n < capacity:
            return None
        return {name: tensor[:n] for name, tensor in tensors.items()}
