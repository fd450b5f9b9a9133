"""Output tensors paged in ahead on a helper thread (agl_plugin_traces.reservation), on real memory."""

import sys

import pytest
import torch

from agl_plugin_traces.reservation import Reservation, populate


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_populate_maps_a_tensors_pages_and_leaves_its_content():
    tensor = torch.empty(3 << 20, dtype=torch.int64)
    tensor[:5] = torch.arange(5)
    assert populate(tensor)
    assert tensor[:5].tolist() == [0, 1, 2, 3, 4]


def test_claim_gives_views_of_the_first_rows_or_none_when_they_do_not_fit():
    columns = {"ids": (6, torch.int64), "scores": (4, torch.float32)}
    reservation = Reservation(columns, capacity=10)
    claimed = reservation.claim(7)
    assert {name: (tuple(t.shape), t.dtype) for name, t in claimed.items()} == {
        "ids": ((7, 6), torch.int64), "scores": ((7, 4), torch.float32)}
    assert all(t.is_contiguous() for t in claimed.values())
    assert Reservation(columns, capacity=10).claim(11) is None
    assert Reservation(columns, capacity=10).claim(4) is None  # the views would hold on to 6 spare rows
