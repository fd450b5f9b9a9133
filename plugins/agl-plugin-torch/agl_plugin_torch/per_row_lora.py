"""Per-row LoRA: one forward computes each row of a batch through its own adapter, every adapter in two GEMMs.

peft computes a mixed-adapter batch (``adapter_names``) by looping, in every
adapted layer, over the adapters the batch names: a sub-batch gathered, two
small matmuls, a scatter back, per adapter per layer per token. Here each
peft ``lora.Linear`` holds its adapters' matrices side by side in one tensor
per side, ``A`` of shape ``(R, in)`` (adapter k's ``lora_A`` is rows
``off_k:off_k+r_k``) and ``Bᵀ`` of shape ``(R, out)`` (adapter k's ``lora_B``
is the transpose of those rows), ``R`` the sum of the ranks, and a batch
whose row b uses adapter ``k_b`` computes

    y = base(x) + ((x @ Aᵀ) * S[k_b]) @ Bᵀ

where ``S[k]`` is adapter k's scaling on its own ``r_k`` columns and zero on
the others (a row of the base policy, or of an adapter the layer does not
have, gets all zeros). It is the batched per-row LoRA of punica and S-LoRA in
plain torch ops, on any device: every adapter's weights are read once per
layer, in one GEMM per side, instead of being gathered per row.

The stacked tensors are not a copy: the adapters' parameters are views into
them (:func:`pack_adapters` rebinds them once, when the adapters are on the
model), so an optimizer step, a checkpoint load or a weight sync writes
straight into what the next batch computes with, and the base weights are
never touched. Whatever rebinds a parameter afterwards (a move to another
device, an adapter added later) is detected when a batch starts, and that
layer is packed again.

Only inference takes this path: with gradients enabled (an update) and on
layers it does not cover (LoRA variants such as DoRA, LoRA biases, embedding
LoRA, ``modules_to_save`` copies) the layer computes peft's own way.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger("agl_plugin_torch")

PACKED = "_agl_per_row_lora"
"""The attribute of a peft ``lora.Linear`` that holds its :class:`Packed` adapters."""


def per_row_delta(x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, row_scales: torch.Tensor) -> torch.Tensor:
    """What the adapters add to a linear layer's output, each row through its own: ``((x @ aᵀ) * S) @ b_t``.

    ``x`` (B, …, in); ``a`` (R, in) and ``b_t`` (R, out): every adapter's
    ``lora_A`` and transposed ``lora_B`` stacked along the rank; ``row_scales``
    (B, R): row b's scaling on its adapter's rank columns, zero elsewhere.
    Returns (B, …, out).
    """
    h = F.linear(x, a)
    return (h * row_scales.view(row_scales.shape[0], *([1] * (x.dim() - 2)), row_scales.shape[1])) @ b_t


@dataclass
class Packed:
    """One layer's adapters stacked: ``names[k]`` holds rows ``offsets[k]:offsets[k]+ranks[k]`` of ``a`` and ``b_t``."""

    names: tuple[str, ...]
    ranks: tuple[int, ...]
    a: torch.Tensor
    b_t: torch.Tensor

    @property
    def offsets(self) -> list[int]:
        return [sum(self.ranks[:k]) for k in range(len(self.ranks))]


def _lora_linear_type():
    from peft.tuners.lora.layer import Linear

    return Linear


def packable(layer: torch.nn.Module) -> bool:
    """Whether ``layer`` is a plain-LoRA peft ``lora.Linear`` (no variant, no bias, unmerged) of one device and
    dtype."""
    if not isinstance(layer, _lora_linear_type()) or layer.merged or getattr(layer, "lora_variant", {}):
        return False
    names = list(layer.lora_A)
    if not names or any(name not in layer.lora_B or layer.lora_B[name].bias is not None for name in names):
        return False
    weights = [layer.lora_A[n].weight for n in names] + [layer.lora_B[n].weight for n in names]
    return len({(w.device, w.dtype) for w in weights}) == 1


@torch.no_grad()
def pack(layer: torch.nn.Module) -> Packed:
    """Stack ``layer``'s adapters into one ``a`` and one ``b_t`` and make its adapter parameters views of them."""
    names = tuple(layer.lora_A)
    a_weights = [layer.lora_A[n].weight for n in names]
    b_weights = [layer.lora_B[n].weight for n in names]
    packed = Packed(names, tuple(w.shape[0] for w in a_weights), torch.cat([w.detach() for w in a_weights]),
                    torch.cat([w.detach().t() for w in b_weights]))
    for a_w, b_w, start, rank in zip(a_weights, b_weights, packed.offsets, packed.ranks):
        a_w.data = packed.a[start:start + rank]
        b_w.data = packed.b_t[start:start + rank].t()
    setattr(layer, PACKED, packed)
    return packed


def packed(layer: torch.nn.Module) -> Packed | None:
    """``layer``'s :class:`Packed` adapters when its parameters are still views of them, else None."""
    held: Packed | None = getattr(layer, PACKED, None)
    if held is None or held.names != tuple(layer.lora_A):
        return None
    for name, start, rank in zip(held.names, held.offsets, held.ranks):
        a_w, b_w = layer.lora_A[name].weight, layer.lora_B[name].weight
        if (a_w.shape[0] != rank or a_w.data_ptr() != held.a[start].data_ptr() or a_w.device != held.a.device
                or b_w.data_ptr() != held.b_t[start].data_ptr() or b_w.stride() != (1, held.b_t.shape[1])):
            return None
    return held


def pack_adapters(model: torch.nn.Module) -> int:
    """Pack every plain-LoRA linear layer of ``model`` whose adapters are not packed yet; how many were.

    Call it in the process that owns the weights, once the adapters are on
    the model on its device (the backend does, right after the actor
    transforms), before any other process maps the weights.
    """
    fresh = 0
    for module in model.modules():
        if packable(module) and packed(module) is None:
            pack(module)
            fresh += 1
    return fresh


@contextmanager
def rows_through_adapters(model: torch.nn.Module, adapters: Sequence[str], base: str) -> Iterator[set[torch.nn.Module]]:
    """Every gradient-free forward of ``model``'s plain-LoRA linear layers in the block computes row i with
    ``adapters[i]``.

    ``base`` is the name that means no adapter. Yields the layers it covers
    (the caller routes the other adapter layers peft's way). A name that is
    neither ``base`` nor an adapter of the model is a ValueError naming them.
    """
    known = list(getattr(model, "peft_config", {}))
    unknown = sorted(set(adapters) - set(known) - {base})
    if unknown:
        raise ValueError(f"adapters {unknown} are not on the model; its adapters are {known} (and {base!r}: none)")
    slot = {name: k for k, name in enumerate(known)}
    installed: list[torch.nn.Module] = []
    scales_of: dict[tuple, torch.Tensor] = {}  # layers with the same adapters, ranks and scalings share them
    try:
        for module in model.modules():
            if not packable(module):
                continue
            held = packed(module)
            if held is None:
                if getattr(module, PACKED, None) is not None:
                    # Legitimate after a move to another device; in a process that maps another's weights it would
                    # mean this process stopped seeing their updates.
                    log.warning("the adapters of %s were rebound off their stacked matrices: stacking them again",
                                type(module).__name__)
                held = pack(module)
            scalings = tuple(float(module.scaling[name]) for name in held.names)
            key = (held.names, held.ranks, scalings, held.a.dtype, held.a.device)
            if key not in scales_of:
                scales_of[key] = _row_scales(held, scalings, adapters, slot, len(known))
            module.forward = _PerRowForward(module, held, scales_of[key], list(adapters))
            installed.append(module)
        yield set(installed)
    finally:
        for module in installed:
            del module.forward


def _row_scales(held: Packed, scalings: tuple[float, ...], adapters: Sequence[str], slot: dict[str, int],
                n_adapters: int) -> torch.Tensor:
    """(B, R): each row's scaling on its adapter's rank columns of ``held``; zeros for the base and absent adapters."""
    table = torch.zeros(n_adapters + 1, sum(held.ranks), dtype=held.a.dtype)
    for name, start, rank, scaling in zip(held.names, held.offsets, held.ranks, scalings):
        table[slot[name], start:start + rank] = scaling
    rows = torch.tensor([slot.get(name, n_adapters) for name in adapters], dtype=torch.long)
    return table[rows].to(held.a.device)


class _PerRowForward:
    """A packed ``lora.Linear``'s forward for the block: the per-row kernel without gradients, else peft's own."""

    def __init__(self, layer: torch.nn.Module, held: Packed, row_scales: torch.Tensor, adapters: list[str]):
        self.layer, self.held, self.row_scales, self.adapters = layer, held, row_scales, adapters

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        layer = self.layer
        kwargs.pop("adapter_names", None)
        if torch.is_grad_enabled() or layer.disable_adapters:
            return type(layer).forward(layer, x, *args, adapter_names=None if layer.disable_adapters else self.adapters,
                                       **kwargs)
        if x.shape[0] != self.row_scales.shape[0]:
            raise ValueError(f"a batch of {x.shape[0]} rows through a layer routed for {self.row_scales.shape[0]}")
        result = layer.base_layer(x, *args, **kwargs)
        delta = per_row_delta(x.to(self.held.a.dtype), self.held.a, self.held.b_t, self.row_scales)
        return result + delta.to(result.dtype)
