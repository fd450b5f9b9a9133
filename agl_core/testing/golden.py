"""Golden metrics: a run's logged metrics checked against ones earlier code logged, bit for bit.

A training run's floats depend on the kind of CPU as well as on the code: torch's kernels (MKL, oneDNN,
vectorised reductions) take other paths on an AMX machine than on an older AVX one, so the same code and seed
log metrics that differ in the last bits (up to 5e-7 apart over the quick start's 30 steps, measured between two
x86-64 kinds). One golden file cannot hold for every machine, so a golden is a folder with one JSONL file per
machine kind it was recorded on: a first line ``{"recorded_on": {...}}`` naming the kind, then the metrics
records. :func:`check_golden` passes a run that equals one of them exactly. On a kind with a file of its own,
that is the only way to pass; on a kind none was recorded on, the run may differ from the nearest file by float
noise only, and a warning says how to record this kind's file with :func:`record_golden`.
"""

from __future__ import annotations

import json
import math
import platform
import warnings
from pathlib import Path
from typing import Any

import torch

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")
"""The CPU flags (as ``/proc/cpuinfo`` names them) that choose torch's kernels on x86-64."""

FLOAT_NOISE = {"rel_tol": 1e-5, "abs_tol": 1e-6}
"""How far a run may differ from a golden recorded on another kind of machine: ten times the gap measured."""


def machine_kind() -> dict[str, Any]:
    """The facts that decide which kernels torch runs here: architecture, torch's CPU capability, ISA flags."""
    cpuinfo = Path("/proc/cpuinfo")
    words = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
    return {"machine": platform.machine(), "torch": torch.__version__,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "flags": [flag for flag in ISA_FLAGS if flag in words]}


def read_metrics(path: Path, ignore: tuple[str, ...]) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``, without the keys that start with any of ``ignore``."""
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(ignore)}
            for line in path.read_text().splitlines() if line.strip()]


def record_golden(metrics: Path, golden_dir: Path, ignore: tuple[str, ...]) -> Path:
    """Write ``metrics`` (less the ``ignore`` keys) as this machine kind's golden file in ``golden_dir``."""
    kind = machine_kind()
    path = golden_dir / f"{'-'.join([kind['machine'], *kind['flags']])}.jsonl"
    golden_dir.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"recorded_on": kind})] + [json.dumps(r) for r in read_metrics(metrics, ignore)]
    path.write_text("\n".join(lines) + "\n")
    return path


def read_golden(path: Path, ignore: tuple[str, ...]) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The machine kind a golden file was recorded on (None when not known) and its records, less ``ignore``."""
    header, *records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return header["recorded_on"], [{k: v for k, v in r.items() if not k.startswith(ignore)} for r in records]


def differences(run: list[dict[str, Any]], golden: list[dict[str, Any]], close: bool = False) -> list[str]:
    """Where ``run`` differs from ``golden`` on the golden's keys (metrics added since are not compared).

    Exact unless ``close``: then floats may differ by :data:`FLOAT_NOISE`, nothing else may differ.
    """
    if [r.get("step") for r in run] != [r["step"] for r in golden]:
        return [f"steps {[r.get('step') for r in run]} != {[r['step'] for r in golden]}"]
    found = []
    for mine, theirs in zip(run, golden):
        for key, want in theirs.items():
            got = mine.get(key)
            same = got == want or (close and isinstance(got, float) and isinstance(want, float)
                                   and math.isclose(got, want, **FLOAT_NOISE))
            if not same:
                found.append(f"step {theirs['step']} {key}: {got!r} != {want!r}")
    return found


def check_golden(metrics: Path, golden_dir: Path, ignore: tuple[str, ...]) -> None:
    """Fail unless the run logged in ``metrics`` equals a golden in ``golden_dir`` as the module docstring says."""
    run = read_metrics(metrics, ignore)
    here = machine_kind()
    goldens = {path: read_golden(path, ignore) for path in sorted(golden_dir.glob("*.jsonl"))}
    if not goldens:
        raise AssertionError(f"no golden files in {golden_dir}")
    found = {path: differences(run, records) for path, (_, records) in goldens.items()}
    if any(not diff for diff in found.values()):
        return
    own = [path for path, (kind, _) in goldens.items() if kind == here]
    if own:
        raise AssertionError(f"{metrics} differs from {own[0]}, recorded on this kind of machine:\n  "
                             + "\n  ".join(found[own[0]][:20]))
    nearest = min(found, key=lambda path: len(found[path]))
    noise = differences(run, goldens[nearest][1], close=True)
    if noise:
        raise AssertionError(f"{metrics} differs from {nearest} by more than float noise {FLOAT_NOISE}:\n  "
                             + "\n  ".join(noise[:20]))
    warnings.warn(f"no golden in {golden_dir} was recorded on this kind of machine ({here}); the run was "
                  f"compared with {nearest.name} within float noise. Record one from a run of the reference code "
                  f"with agl_core.testing.golden.record_golden.", stacklevel=2)
