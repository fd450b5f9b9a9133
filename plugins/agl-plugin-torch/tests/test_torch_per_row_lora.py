"""The per-row LoRA kernel's math against a row-by-row reference (peft's layers are tested in agl-plugin-lora)."""

from __future__ import annotations

import torch

from agl_plugin_torch.per_row_lora import per_row_delta


def test_each_row_gets_its_own_adapters_delta_and_base_rows_none():
    gen = torch.Generator().manual_seed(0)
    d_in, d_out, ranks, scalings = 12, 10, [4, 2, 3], [2.0, 0.5, 1.5]
    a_parts = [torch.randn(r, d_in, generator=gen) for r in ranks]  # lora_A of each adapter: (r, in)
    b_parts = [torch.randn(d_out, r, generator=gen) for r in ranks]  # lora_B: (out, r)
    a, b_t = torch.cat(a_parts), torch.cat([b.t() for b in b_parts])
    rows = [0, 2, None, 1, 0, None]  # None: the base policy, no adapter
    row_scales = torch.zeros(len(rows), sum(ranks))
    for i, k in enumerate(rows):
        if k is not None:
            start = sum(ranks[:k])
            row_scales[i, start:start + ranks[k]] = scalings[k]
    x = torch.randn(len(rows), 5, d_in, generator=gen)  # (B, T, in), as a decoder's linear layers see it

    got = per_row_delta(x, a, b_t, row_scales)

    for i, k in enumerate(rows):
        expected = torch.zeros(5, d_out) if k is None else scalings[k] * (x[i] @ a_parts[k].t() @ b_parts[k].t())
        torch.testing.assert_close(got[i], expected, atol=1e-5, rtol=1e-5)
    assert got[1].abs().max() > 1e-2  # not vacuous


def test_two_dimensional_inputs_are_rows_too():
    gen = torch.Generator().manual_seed(1)
    a, b_t = torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen)
    x, scales = torch.randn(2, 6, generator=gen), torch.tensor([[1.0, 1.0, 0, 0], [0, 0, 3.0, 3.0]])
    got = per_row_delta(x, a, b_t, scales)
    torch.testing.assert_close(got[0], x[0] @ a[:2].t() @ b_t[:2])
    torch.testing.assert_close(got[1], 3.0 * (x[1] @ a[2:].t() @ b_t[2:]))
