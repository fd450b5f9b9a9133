"""SIGINT (Ctrl-C) and SIGTERM mid-run: a clean exit with 128 + the signal, and the next start resumes.

Real ``agl`` processes on the quickstart recipe; the signal is sent while the
trainer is well inside its steps.
"""

from __future__ import annotations

import json
import signal

import pytest


def steps(run_dir) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_mid_run_ends_it_cleanly_and_the_next_start_resumes(agl, run_dir, tmp_path, signum):
    log = tmp_path / "trainer.log"
    trainer = agl.spawn("train", agl.QUICKSTART, f"trainer.run_dir={run_dir}", "trainer.total_steps=100000",
                        "trainer.save_freq=5", "trainer.progress=false", log=log)
    try:
        agl.wait_until(lambda: len(steps(run_dir)) > 7, 60, "steps past the first checkpoint")
        trainer.send_signal(signum)
        code = trainer.wait(60)
    finally:
        trainer.kill()  # a no-op when it has ended
    output = log.read_text()
    assert code == 128 + signum, output[-3000:]
    assert "Traceback" not in output
    name = signal.Signals(signum).name
    (line,) = [line for line in output.splitlines() if line.startswith("agl: interrupted")]
    assert line.startswith(f"agl: interrupted by {name} at step ") and "trainer.resume=auto" in line
    assert "timing over" in output  # every plugin's on_train_end ran: the console logger's summary
    assert (run_dir / ".agl.lock").read_text() == ""  # released, not left stale

    interrupted_at = int(line.removeprefix(f"agl: interrupted by {name} at step ").split()[0])
    total = interrupted_at + 2
    out = agl.run("train", agl.QUICKSTART, f"trainer.run_dir={run_dir}", "trainer.resume=auto",
                  f"trainer.total_steps={total}", "trainer.save_freq=5", "trainer.progress=false", timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from" in out.stderr and "stale lock" not in out.stderr
    assert steps(run_dir) == list(range(total + 1))
