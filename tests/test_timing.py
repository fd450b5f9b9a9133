"""Stage timers and the end-of-run timing summary."""

from __future__ import annotations

from agl_core.timing import MODEL_STAGES, timer, timing_summary


def test_timer_adds_up_the_seconds_of_its_blocks():
    timing: dict[str, float] = {}
    for _ in range(2):
        with timer("stage", timing):
            pass
    assert set(timing) == {"stage"} and 0 <= timing["stage"] < 1


def test_the_summary_gives_each_stage_its_share_and_the_core_the_rest():
    totals = {"step": 10.0, "gen": 6.0, "update_actor": 3.0, "old_log_prob": 0.5, "adv": 0.25}
    lines = timing_summary(totals, steps=4).splitlines()
    assert lines[0] == "timing over 4 steps (10.0 s of steps, 2.500 s a step):"
    assert lines[1].split() == ["timing_s/gen", "6.000", "s", "60.00%"]  # largest first
    assert lines[-1].endswith("0.500 s, 5.00%")  # 10 - 6 - 3 - 0.5: adv is the core's
    assert "gen" in MODEL_STAGES and "adv" not in MODEL_STAGES
    assert timing_summary({}, steps=0) == "timing: no training step ran"
