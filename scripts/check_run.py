#!/usr/bin/env python
"""Check that a run directory shows a run that trained: exit 0 when every check passes, 1 when one fails.

    python scripts/check_run.py RUN_DIR [--steps N] [--resumed-at K] [--no-learning] [--initial-model DIR]

It reads what every ``agl train`` writes, whatever the backend: ``config.yaml``
(the recipe as run), ``metrics.jsonl`` (one row a step, the step's last row
counting when a resumed run logged it again) and ``checkpoints/``. Checks:

- every step 1..N logged (N: ``trainer.total_steps``, or ``--steps``) and none skipped
  (``training/skipped_step``, which a step whose rollouts all failed or were filtered logs);
- model calls made and none failed (``training/n_calls`` > 0, ``training/n_calls_error`` = 0),
  rollouts succeeded (``rollout/n_failed`` = 0), rows built (``training/n_triplets`` > 0);
- finite ``actor/pg_loss`` and ``actor/grad_norm`` (and the critic's when it trains), no optimizer step skipped
  for a non-finite gradient; with learning expected (the default), a gradient in every step and weights that moved;
- the served policy is the trained one: the importance weights of the trainer's log-probs over the served
  ones for the same tokens, ``rollout_corr/tis_mean`` in [0.9, 1.1] and ``rollout_corr/tis_max`` <= 4;
- validation logged on its schedule (``trainer.test_freq``), finite;
- a checkpoint of the last step when ``trainer.save_freq`` asks for one;
- ``--resumed-at K``: the run was resumed from ``global_step_K``: the steps after K are logged, and the weights
  of the last checkpoint are nearer to step K's than to the initial model's (a run that started over is not).

Weights are compared where checkpoints hold ``*.safetensors`` (the embedded backend's ``actor/``, verl's
``huggingface/`` when ``hf_model`` is saved); the initial model is ``RUN_DIR/model`` (a made model) or
``--initial-model``. ``--no-learning`` is for runs whose rewards cannot vary (a randomly initialised model
that never scores): it drops the gradient and weights-moved checks, not the rest.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import yaml

TIS_MEAN = (0.9, 1.1)
TIS_MAX = 4.0


class Report:
    """The checks' outcomes, printed as they are made."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def check(self, ok: bool, what: str, why: str = "") -> bool:
        print(f"{'PASS' if ok else 'FAIL'}  {what}" + ("" if ok or not why else f": {why}"))
        if not ok:
            self.failures.append(what + (f": {why}" if why else ""))
        return ok

    def note(self, what: str) -> None:
        print(f"note  {what}")


def finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def read_rows(path: Path) -> tuple[dict[int, dict], dict[int, dict]]:
    """``(train, val)``: the last logged row of each step, of the training steps and of the validations."""
    train: dict[int, dict] = {}
    val: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        step = int(row["step"])
        if any(key.startswith("val/") for key in row):
            val.setdefault(step, {}).update({k: v for k, v in row.items() if k.startswith("val/")})
        if step >= 1 and ("timing_s/step" in row or "training/skipped_step" in row or "training/n_calls" in row):
            train[step] = row
    return train, val


def bad_steps(train: dict[int, dict], test) -> list[str]:
    """``"step: value"`` of the steps whose row fails ``test(row)`` (which returns None when the row is good)."""
    out = []
    for step, row in sorted(train.items()):
        problem = test(row)
        if problem is not None:
            out.append(f"step {step}: {problem}")
    return out


def check_steps(report: Report, train: dict[int, dict], steps: int, learning: bool) -> None:
    missing = [s for s in range(1, steps + 1) if s not in train]
    report.check(not missing, f"steps 1..{steps} logged", f"missing {missing[:10]}")
    report.check(not (bad := bad_steps(train, lambda r: "skipped" if r.get("training/skipped_step") else None)),
                 "no step skipped (training/skipped_step)", "; ".join(bad[:5]))

    def calls(row):
        n, errors = row.get("training/n_calls", 0), row.get("training/n_calls_error", 0)
        if not n:
            return "no model call"
        return f"{errors:.0f} of {n:.0f} calls failed" if errors else None
    report.check(not (bad := bad_steps(train, calls)), "model calls made, none failed", "; ".join(bad[:5]))
    report.check(not (bad := bad_steps(train, lambda r: f"{r['rollout/n_failed']:.0f} failed"
                                       if r.get("rollout/n_failed") else None)),
                 "no rollout failed", "; ".join(bad[:5]))
    report.check(not (bad := bad_steps(train, lambda r: None if r.get("training/n_triplets", 0) > 0
                                       else "no trainable row")), "training rows built", "; ".join(bad[:5]))

    def losses(row):
        for key in ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm"):
            if key.startswith("actor/") and key not in row:
                return f"{key} not logged"
            if key in row and not finite(row[key]):
                return f"{key}={row[key]}"
        for key in ("actor/skipped_steps", "critic/skipped_steps"):
            if row.get(key):
                return f"{key}={row[key]:.0f} (a non-finite gradient)"
        return None
    report.check(not (bad := bad_steps(train, losses)), "finite losses and gradient norms", "; ".join(bad[:5]))
    if learning:
        report.check(not (bad := bad_steps(train, lambda r: None if r.get("actor/grad_norm", 0) > 0
                                           else "actor/grad_norm = 0")),
                     "a policy gradient in every step", "; ".join(bad[:5]))

    def served(row):
        mean, top = row.get("rollout_corr/tis_mean"), row.get("rollout_corr/tis_max")
        if mean is None or top is None:
            return "no rollout_corr/tis_* (the server returned no log-probs of its samples?)"
        if not (TIS_MEAN[0] <= mean <= TIS_MEAN[1]) or not top <= TIS_MAX:
            return f"tis_mean={mean:.4g}, tis_max={top:.4g}"
        return None
    report.check(not (bad := bad_steps(train, served)),
                 f"served log-probs match the trainer's (TIS mean in [{TIS_MEAN[0]}, {TIS_MEAN[1]}], "
                 f"max <= {TIS_MAX})", "; ".join(bad[:5]))


def check_validation(report: Report, val: dict[int, dict], config: dict, steps: int) -> None:
    trainer = config.get("trainer", {})
    freq = trainer.get("test_freq") or 0
    if freq <= 0 or not config.get("data", {}).get("val_files"):
        report.note("no validation asked (trainer.test_freq)")
        return
    due = [s for s in range(freq, steps + 1, freq)]
    missing = [s for s in due if s not in val]
    report.check(not missing, f"validation logged at steps {due}", f"missing at {missing}")
    bad = [s for s, row in val.items() if not finite(row.get("val/reward/mean"))]
    report.check(not bad, "validation rewards finite", f"steps {bad}")


def safetensors_of(directory: Path) -> dict:
    """The tensors of every ``*.safetensors`` file under ``directory``, by name (float32 on the CPU)."""
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(directory.rglob("*.safetensors")):
        tensors.update({name: t.float() for name, t in load_file(str(path)).items()})
    return tensors


def distance(a: dict, b: dict) -> float | None:
    """The L2 distance over the tensors both hold (None when they share none)."""
    import torch

    common = [name for name in a if name in b and a[name].shape == b[name].shape]
    if not common:
        return None
    return math.sqrt(sum(float(torch.sum((a[n] - b[n]) ** 2)) for n in common))


def check_checkpoints(report: Report, run_dir: Path, config: dict, steps: int, learning: bool,
                      resumed_at: int | None, initial_model: Path | None) -> None:
    checkpoints = run_dir / "checkpoints"
    freq = config.get("trainer", {}).get("save_freq") or 0
    last = checkpoints / f"global_step_{steps}"
    if freq > 0 and steps % freq == 0 or resumed_at is not None:
        report.check(last.is_dir() and any(last.iterdir()), f"checkpoint {last.relative_to(run_dir)} present",
                     "missing or empty")
    else:
        found = sorted(checkpoints.glob("global_step_*")) if checkpoints.is_dir() else []
        report.note(f"trainer.save_freq={freq} asks for no checkpoint at step {steps}; found "
                    f"{[p.name for p in found]}")
    initial_dir = initial_model or (run_dir / "model")
    initial = safetensors_of(initial_dir) if initial_dir.is_dir() else {}
    final = safetensors_of(last) if last.is_dir() else {}
    if learning and final:
        moved = distance(final, initial) if initial else None
        adapter_b = [t for name, t in final.items() if "lora_B" in name]
        if moved is not None:
            report.check(moved > 0, f"weights moved from the initial model (L2 {moved:.4g})", "they did not")
        elif adapter_b:  # a LoRA adapter's B matrices start at zero: trained, they are not
            norm = math.sqrt(sum(float((t ** 2).sum()) for t in adapter_b))
            report.check(norm > 0, f"the LoRA adapter trained (L2 of its B matrices {norm:.4g})", "they are zero")
        else:
            report.note("weights moved: not checked (no initial weights of the same names to compare with)")
    if resumed_at is not None:
        start = checkpoints / f"global_step_{resumed_at}"
        if not report.check(start.is_dir(), f"checkpoint global_step_{resumed_at} (resumed from) present"):
            return
        resumed = safetensors_of(start)
        to_start, to_initial = distance(final, resumed), distance(final, initial) if initial else None
        if to_start is None:
            report.note("resume: weights not compared (the checkpoints hold no safetensors)")
        elif to_initial is None:
            report.check(to_start > 0, f"resumed run trained on from step {resumed_at} (L2 {to_start:.4g})")
        else:
            report.check(to_start < to_initial,
                         f"resumed from step {resumed_at}'s weights (L2 to them {to_start:.4g} < to the initial "
                         f"model {to_initial:.4g})", "the last weights are nearer the initial model: started over?")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--steps", type=int, help="steps the run should have logged (default trainer.total_steps)")
    parser.add_argument("--resumed-at", type=int, help="the run was resumed from this step's checkpoint")
    parser.add_argument("--no-learning", action="store_true",
                        help="rewards cannot vary here: no gradient or weights-moved check")
    parser.add_argument("--initial-model", type=Path, help="the initial model's directory (default RUN_DIR/model)")
    args = parser.parse_args(argv)
    run_dir: Path = args.run_dir
    report = Report()
    metrics, config_file = run_dir / "metrics.jsonl", run_dir / "config.yaml"
    if not report.check(metrics.is_file() and config_file.is_file(), f"{run_dir} is a run directory",
                        "no metrics.jsonl or config.yaml"):
        return 1
    config = yaml.safe_load(config_file.read_text()) or {}
    steps = args.steps or config.get("trainer", {}).get("total_steps")
    if not report.check(isinstance(steps, int) and steps > 0, "number of steps known",
                        "trainer.total_steps is not set: pass --steps"):
        return 1
    train, val = read_rows(metrics)
    check_steps(report, train, steps, learning=not args.no_learning)
    check_validation(report, val, config, steps)
    check_checkpoints(report, run_dir, config, steps, not args.no_learning, args.resumed_at, args.initial_model)
    if report.failures:
        print(f"\n{run_dir}: FAILED {len(report.failures)} check(s):")
        for failure in report.failures:
            print(f"  - {failure}")
        return 1
    print(f"\n{run_dir}: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
