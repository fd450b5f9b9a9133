"""The judge: verdict parsing, scoring over real HTTP (the test endpoint echoes the judge's prompt, so a
transcript that ends in "SCORE: 7" is judged 7), failures and garbage marking the rollout, the cache, and a
whole run with the embedded backend serving a checkpoint as the judge."""

from __future__ import annotations

import re

import pytest

from agl_core.data import Rollout, Span
from agl_core.testing.endpoint import ByteTokenizer
from agl_plugin_teachers.endpoints import Served
from agl_plugin_teachers.judge import Judge, parse_verdict
from agl_plugin_teachers.settings import JudgeConfig

from runs import logged, recipe_file, train

PATTERN = re.compile(JudgeConfig.model_fields["verdict_pattern"].default)


def game(rollout_id: str, text: str, status="succeeded", reward=1.0) -> Rollout:
    ids = ByteTokenizer().encode(text)
    return Rollout(rollout_id=rollout_id, task_id="t", status=status, final_reward=reward, spans=[
        Span(rollout_id=rollout_id, sequence_id=0, kind="llm_call", prompt_token_ids=ids[:3],
             response_token_ids=ids[3:])])


def judge(endpoint, **settings) -> Judge:
    config = JudgeConfig(endpoint=endpoint.url, prompt="{transcript}", max_tokens=200, **settings)
    return Judge(Served(config, "judge"), config, ByteTokenizer())


def test_verdicts_are_the_last_match_of_the_pattern():
    assert parse_verdict("I think SCORE: 3 ... no.\nSCORE: 8.5", PATTERN) == 8.5
    assert parse_verdict("SCORE: -2", PATTERN) == -2.0
    assert parse_verdict("a fine game, 9/10", PATTERN) is None
    assert parse_verdict("", PATTERN) is None
    assert parse_verdict("verdict=yes", re.compile(r"verdict=(\w+)")) is None  # not a number: no score


def test_judged_rewards_replace_the_agents_and_garbage_marks_the_rollout(endpoint):
    rollouts = [game("a", "won SCORE: 7"), game("b", "lost SCORE: 2"), game("c", "no verdict here"),
                game("d", "crashed", status="failed", reward=None)]
    j = judge(endpoint)
    try:
        judged, metrics = j.judge(rollouts, {})
        assert [r.final_reward for r in judged[:2]] == pytest.approx([0.7, 0.2])
        assert judged[2].status == "failed" and "no verdict" in judged[2].error and judged[2].final_reward == 1.0
        assert judged[3] is rollouts[3]
        assert metrics["judge/n_scored"] == 2 and metrics["judge/n_garbage"] == 1 and metrics["judge/n_failed"] == 0
        assert metrics["judge/score_mean"] == pytest.approx(0.45)
        assert metrics["judge/prompt_tokens"] > 0 and metrics["judge/completion_tokens"] > 0
        calls = endpoint.calls
        again, metrics = j.judge(rollouts, {})  # cached per rollout: no request, the same verdicts
        assert endpoint.calls == calls and metrics["judge/cache_hits"] == 3
        assert [r.final_reward for r in again[:2]] == pytest.approx([0.7, 0.2])
    finally:
        j.close()


def test_added_to_the_reward_with_a_weight(endpoint):
    j = judge(endpoint, mode="add", weight=0.5)
    try:
        judged, _ = j.judge([game("a", "SCORE: 7", reward=1.0)], {})
    finally:
        j.close()
    assert judged[0].final_reward == pytest.approx(1.0 + 0.5 * 0.7)


def test_a_failing_judge_marks_the_rollouts_never_a_silent_zero(endpoint):
    endpoint.fail_next.extend([500] * 4)
    j = judge(endpoint, max_retries=1)
    try:
        judged, metrics = j.judge([game("a", "SCORE: 7"), game("b", "SCORE: 9")], {})
    finally:
        j.close()
    assert metrics["judge/n_failed"] == 2 and metrics["judge/n_scored"] == 0
    assert all(r.status == "failed" and "judge 'judge' at http://127.0.0.1" in r.error and "after 1 retries" in r.error
               for r in judged)
    assert [r.final_reward for r in judged] == [1.0, 1.0]  # untouched: the rollout is not trained on


def test_a_run_whose_judge_answers_garbage_trains_on_nothing(tmp_path, checkpoint):
    """The judge is a tiny random model served by the embedded backend: its answers hold no verdict (or its
    context is too short for a transcript), so every game is marked failed and the steps are skipped, never
    trained with reward 0."""
    path = recipe_file(tmp_path, plugins={"judge": {"model_path": str(checkpoint), "max_tokens": 4}},
                       trainer={"run_dir": str(tmp_path / "judged")})
    metrics = logged(train(path, ["judge"]).ctx.run_dir)
    for step in (1, 2):
        # garbage, or a 400 for a transcript longer than the tiny judge's context: every game marked either way
        assert metrics[step]["judge/n_garbage"] + metrics[step]["judge/n_failed"] == 4
        assert metrics[step]["judge/n_scored"] == 0
        assert metrics[step]["training/skipped_step"] == 1.0
