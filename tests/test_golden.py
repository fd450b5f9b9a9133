"""Golden metrics (agl_core.testing.golden): exact on a recorded machine kind, float noise only on another."""

from __future__ import annotations

import json

import pytest

from agl_core.testing import golden
from agl_core.testing.golden import check_golden, record_golden

HERE = {"machine": "x86_64", "torch": "2.13.0+cpu", "torch_cpu_capability": "AVX512", "flags": ["avx2", "avx512f"]}
ELSEWHERE = {**HERE, "flags": ["avx2"]}


def write_metrics(path, pg_loss, extra=None):
    records = [{"step": 0, "val/reward/mean": 0.0},
               {"step": 1, "actor/pg_loss": pg_loss, "timing_s/step": 1.5, **(extra or {})}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def kind(monkeypatch):
    """Pins what machine_kind() reports, so a test says which kind of machine it runs on."""
    def on(machine):
        monkeypatch.setattr(golden, "machine_kind", lambda: machine)
    return on


def record_on(machine, kind, tmp_path, pg_loss):
    kind(machine)
    return record_golden(write_metrics(tmp_path / f"ref{pg_loss}.jsonl", pg_loss), tmp_path / "golden", ("timing_s/",))


def test_a_recorded_file_names_its_machine_and_leaves_out_the_ignored_keys(tmp_path, kind):
    path = record_on(HERE, kind, tmp_path, -0.125)
    assert path.name == "x86_64-avx2-avx512f.jsonl"
    header, *records = [json.loads(line) for line in path.read_text().splitlines()]
    assert header == {"recorded_on": HERE}
    assert records[1] == {"step": 1, "actor/pg_loss": -0.125}


def test_an_equal_run_passes_and_metrics_added_since_are_not_compared(tmp_path, kind):
    record_on(HERE, kind, tmp_path, -0.125)
    run = write_metrics(tmp_path / "run.jsonl", -0.125, extra={"training/new_metric": 3.0})
    check_golden(run, tmp_path / "golden", ("timing_s/",))


def test_on_a_recorded_kind_the_last_bit_counts(tmp_path, kind):
    record_on(HERE, kind, tmp_path, -0.125)
    run = write_metrics(tmp_path / "run.jsonl", -0.125 * (1 + 1e-9))
    with pytest.raises(AssertionError, match=r"recorded on this kind of machine:\n  step 1 actor/pg_loss"):
        check_golden(run, tmp_path / "golden", ("timing_s/",))


def test_a_run_equal_to_another_kinds_file_passes(tmp_path, kind):
    record_on(ELSEWHERE, kind, tmp_path, -0.5)
    record_on(HERE, kind, tmp_path, -0.125)
    check_golden(write_metrics(tmp_path / "run.jsonl", -0.5), tmp_path / "golden", ("timing_s/",))


def test_on_an_unrecorded_kind_float_noise_passes_with_a_warning_and_more_fails(tmp_path, kind):
    record_on(ELSEWHERE, kind, tmp_path, -0.125)
    kind(HERE)
    with pytest.warns(UserWarning, match="no golden .* was recorded on this kind of machine"):
        check_golden(write_metrics(tmp_path / "run.jsonl", -0.125 * (1 + 1e-7)), tmp_path / "golden", ("timing_s/",))
    with pytest.raises(AssertionError, match="by more than float noise"):
        check_golden(write_metrics(tmp_path / "run.jsonl", -0.126), tmp_path / "golden", ("timing_s/",))


def test_a_missing_metric_or_step_fails(tmp_path, kind):
    record_on(HERE, kind, tmp_path, -0.125)
    run = tmp_path / "run.jsonl"
    run.write_text(json.dumps({"step": 0, "val/reward/mean": 0.0}) + "\n")
    with pytest.raises(AssertionError, match=r"steps \[0\] != \[0, 1\]"):
        check_golden(run, tmp_path / "golden", ("timing_s/",))
    run.write_text(json.dumps({"step": 0}) + "\n" + json.dumps({"step": 1}) + "\n")
    with pytest.raises(AssertionError, match="step 0 val/reward/mean: None != 0.0"):
        check_golden(run, tmp_path / "golden", ("timing_s/",))
