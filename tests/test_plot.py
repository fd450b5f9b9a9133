"""`agl plot RUN_DIR`: the curves of a run's metrics.jsonl as a PNG."""

import json

import pytest

from agl_core.builtin.plot import curve, plot_run, read_metrics
from agl_core.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_metrics(run_dir, records):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_resumed_step_keeps_its_last_record_and_nulls_are_gaps(tmp_path):
    write_metrics(tmp_path, [{"step": 0, "val/reward/mean": 0.1},
                             {"step": 1, "actor/entropy": 2.0, "actor/ppo_kl": None},
                             {"step": 2, "actor/entropy": 1.5},
                             {"step": 2, "actor/entropy": 1.4, "val/reward/mean": 0.9}])
    metrics = read_metrics(tmp_path)
    assert list(metrics) == [0, 1, 2]
    assert curve(metrics, "actor/entropy") == ([1, 2], [2.0, 1.4])
    assert curve(metrics, "val/reward/mean") == ([0, 2], [0.1, 0.9])
    assert curve(metrics, "actor/ppo_kl") == ([], [])


def test_plot_writes_a_png_with_missing_curves_marked(tmp_path):
    records = [{"step": s, "critic/score/mean_before_processing": s / 10, "actor/entropy": 3 - s / 10,
                "actor/ppo_kl": 0.01, "timing_s/step": 1.0, "response_length/mean_before_processing": 5.0}
               for s in range(1, 11)]
    write_metrics(tmp_path / "run", [{"step": 0, "val/reward/mean": 0.0}, *records])
    out = plot_run(tmp_path / "run")
    assert out == tmp_path / "run" / "curves.png"
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_cli_plot_prints_the_png_path(tmp_path, capsys):
    write_metrics(tmp_path / "run", [{"step": 1, "actor/entropy": 1.0}])
    assert main(["plot", str(tmp_path / "run"), "-o", str(tmp_path / "x.png")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "x.png")
    assert (tmp_path / "x.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("content, message", [(None, "has no metrics.jsonl"), ("{oops\n", "metrics.jsonl:1")])
def test_cli_plot_of_a_directory_without_metrics_is_one_clear_error(tmp_path, capsys, content, message):
    if content is not None:
        (tmp_path / "metrics.jsonl").write_text(content)
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("agl: error:") and message in err
