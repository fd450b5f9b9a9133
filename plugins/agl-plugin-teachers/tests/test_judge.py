"""The judge: verdict parsing, scoring over real HTTP (the test endpoint echoes the judge's prompt, so a
transcript that ends in "SCORE: 7" is judged 7), failures and garbage marking the rollout, the cache, and a
whole run with the embedded backend serving a checkpoint as the judge. Per turn: each call's verdict in the rows'
per-call columns (source ``judge``), failed turns marked and not trained on, and a whole run whose step-level
estimator reads the judged turns."""

from __future__ import annotations

import re

import pytest

from agl_core.builtin.batch_calls import batch_calls
from agl_core.data import Rollout, Span, Triplet
from agl_core.testing.endpoint import ByteTokenizer
from agl_plugin_teachers.judge import Judge, build_judge
from agl_plugin_teachers.settings import JudgeConfig
from agl_plugin_teachers.verdicts import parse_verdict
from agl_plugin_traces.trajectory import trajectory_batch

from runs import logged, recipe_file, train

PATTERN = re.compile(JudgeConfig.model_fields["verdict_pattern"].default)


def game(rollout_id: str, text: str, status="succeeded", reward=1.0) -> Rollout:
    ids = ByteTokenizer().encode(text)
    return Rollout(rollout_id=rollout_id, task_id="t", status=status, final_reward=reward, spans=[
        Span(rollout_id=rollout_id, sequence_id=0, kind="llm_call", prompt_token_ids=ids[:3],
             response_token_ids=ids[3:])])


def judge(endpoint, **settings) -> Judge:
    config = JudgeConfig(endpoint=endpoint.url, **{"prompt": "{transcript}", "max_tokens": 200, **settings})
    return build_judge(config, ByteTokenizer())


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


# ---------------------------------------------------------------------------------------------- per turn


def conversation(rollout_id: str, answers: list[str], reward: float | None = 1.0, call_rewards=None) -> Rollout:
    """A rollout of one call per answer, each prompt extending the previous call's prompt and response (one
    conversation), and a reward span after each call ``call_rewards`` names ({turn: reward})."""
    tok, spans, context, sequence = ByteTokenizer(), [], [], 0
    for turn, answer in enumerate(answers):
        prompt = context + tok.encode(f"<user>go {turn}<agent>")
        spans.append(Span(rollout_id=rollout_id, sequence_id=sequence, kind="llm_call", prompt_token_ids=prompt,
                          response_token_ids=tok.encode(answer)))
        sequence += 1
        if turn in (call_rewards or {}):
            spans.append(Span(rollout_id=rollout_id, sequence_id=sequence, kind="reward", reward=call_rewards[turn]))
            sequence += 1
        context = prompt + tok.encode(answer)
    return Rollout(rollout_id=rollout_id, task_id="t", status="succeeded", final_reward=reward, spans=spans)


def rows(rollouts):
    batch, metrics, _ = trajectory_batch(rollouts, 200, 400)
    return batch, metrics


def test_each_turn_is_judged_into_its_calls_own_reward(endpoint):
    j = judge(endpoint, per="turn")
    try:
        judged, metrics = j.judge([conversation("a", ["SCORE: 2", "SCORE: 5", "SCORE: 9"])], {})
        assert metrics["judge/n_scored"] == 3 and metrics["judge/score_mean"] == pytest.approx(16 / 30)
        assert judged[0].final_reward == pytest.approx(1.6)  # replace: the sum of the judged turns
        batch, _ = rows(judged)
        assert batch["call_rewards"].tolist() == [pytest.approx([0.2, 0.5, 0.9])]
        assert batch["call_reward_sources"].tolist() == [["judge"] * 3]
        batch["token_level_rewards"] = batch["token_level_scores"]  # what the loop sets before the estimator
        calls = batch_calls(batch)
        assert calls.own.tolist() == [True] * 3 and calls.reward.tolist() == pytest.approx([0.2, 0.5, 0.9])
        # The transcript of turn t is the conversation up to and including it: its prompt and its response.
        prompts = [r["messages"][0]["content"] for r in list(endpoint.requests)[-3:]]
        assert sorted(prompts, key=len)[1] == "<user>go 0<agent>SCORE: 2<user>go 1<agent>SCORE: 5"
        calls_before = endpoint.calls
        again, metrics = j.judge([conversation("a", ["SCORE: 2", "SCORE: 5", "SCORE: 9"])], {})
        assert endpoint.calls == calls_before and metrics["judge/cache_hits"] == 3  # cached per (rollout, turn)
        assert rows(again)[0]["call_rewards"].tolist() == [pytest.approx([0.2, 0.5, 0.9])]
    finally:
        j.close()


def test_a_turn_alone_is_what_it_adds_to_the_conversation(endpoint):
    j = judge(endpoint, per="turn", turn_transcript="turn")
    try:
        j.judge([conversation("a", ["SCORE: 2", "SCORE: 5"])], {})
    finally:
        j.close()
    prompts = sorted(r["messages"][0]["content"] for r in list(endpoint.requests)[-2:])
    assert prompts == ["<user>go 0<agent>SCORE: 2", "<user>go 1<agent>SCORE: 5"]


def test_added_per_turn_to_the_rewards_the_estimators_would_have_read(endpoint):
    j = judge(endpoint, per="turn", mode="add", weight=0.5)
    try:
        # No call reward: the rollout's reward (1.0) was the last call's.
        outcome, _ = j.judge([conversation("a", ["SCORE: 2", "SCORE: 4"], reward=1.0)], {})
        # The agent rewarded turn 0 itself (0.3): its rewards were the calls' own, 0 on turn 1.
        shaped, _ = j.judge([conversation("b", ["SCORE: 2", "SCORE: 4"], reward=1.0, call_rewards={0: 0.3})], {})
    finally:
        j.close()
    assert rows(outcome)[0]["call_rewards"].tolist() == [pytest.approx([0.1, 1.2])]
    assert outcome[0].final_reward == pytest.approx(1.0 + 0.5 * 0.6)
    batch, metrics = rows(shaped)
    assert batch["call_rewards"].tolist() == [pytest.approx([0.4, 0.2])]
    assert batch["call_reward_sources"].tolist() == [["judge", "judge"]]
    assert metrics["training/n_call_rewards"] == 2  # the agent's span gave way to the judge's, which counts it


def test_a_turn_without_verdict_is_marked_and_not_trained_on(endpoint):
    j = judge(endpoint, per="turn", turn_transcript="turn")  # alone: no earlier turn's verdict in its transcript
    try:
        judged, metrics = j.judge([conversation("a", ["SCORE: 2", "no idea", "SCORE: 9"]),
                                   conversation("b", ["hmm", "what"])], {})
    finally:
        j.close()
    assert metrics["judge/n_scored"] == 2 and metrics["judge/n_garbage"] == 3
    assert metrics["judge/n_rollouts_failed"] == 1
    assert judged[0].status == "succeeded" and judged[0].final_reward == pytest.approx(1.1)
    assert "no verdict" in [s for s in judged[0].spans if s.kind == "llm_call"][1].attributes["error"]
    assert judged[1].status == "failed" and "turn 0:" in judged[1].error and "turn 1:" in judged[1].error
    batch, trace_metrics = rows(judged)
    assert trace_metrics["training/n_calls_error"] == 1  # the unjudged turn is context, never trained with 0
    assert batch["call_turns"].tolist() == [[0, 2]]
    assert batch["call_rewards"].tolist() == [pytest.approx([0.2, 0.9])]
    turn_ids = batch["turn_ids"][0]
    assert set(turn_ids.tolist()) == {-1, 0, 2}


def test_a_rollout_of_triplets_is_judged_per_triplet(endpoint):
    """A rollout that carries triplets and no llm_call spans: each judged triplet gets the judged reward, marked the
    judge's; one without a verdict is left out."""
    tok = ByteTokenizer()
    triplets = [Triplet(prompt_ids=tok.encode(f"go {t} "), response_ids=tok.encode(answer), rollout_id="a",
                        turn_index=t) for t, answer in enumerate(["SCORE: 3", "nothing", "SCORE: 8"])]
    rollout = Rollout(rollout_id="a", task_id="t", status="succeeded", final_reward=1.0, triplets=triplets)
    j = judge(endpoint, per="turn")
    try:
        [judged], metrics = j.judge([rollout], {})
    finally:
        j.close()
    assert metrics["judge/n_scored"] == 2 and metrics["judge/n_garbage"] == 1
    assert [(t.turn_index, t.reward, t.metadata["reward_source"]) for t in judged.triplets] == [
        (0, pytest.approx(0.3), "judge"), (2, pytest.approx(0.8), "judge")]
    batch, _ = rows([judged])
    assert batch["call_reward_sources"][batch["call_turns"] >= 0].tolist() == ["judge", "judge"]


def test_a_failing_judge_marks_every_turn(endpoint):
    endpoint.fail_next.extend([500] * 8)
    j = judge(endpoint, per="turn", max_retries=1)
    try:
        judged, metrics = j.judge([conversation("a", ["SCORE: 2", "SCORE: 9"])], {})
    finally:
        j.close()
    assert metrics["judge/n_failed"] == 2 and metrics["judge/n_rollouts_failed"] == 1
    assert judged[0].status == "failed" and "after 1 retries" in judged[0].error
    assert judged[0].final_reward == 1.0


def test_a_run_whose_step_level_estimator_reads_the_judged_turns(tmp_path, endpoint):
    """The test endpoint is the judge: it echoes the prompt ``SCORE: {turn}``, so turn t is judged t."""
    path = recipe_file(tmp_path, algorithm={"estimator": "turn_grpo"},
                       plugins={"judge": {"endpoint": endpoint.url, "per": "turn", "prompt": "SCORE: {turn}",
                                          "max_tokens": 20}})
    metrics = logged(train(path, ["judge"]).ctx.run_dir)
    for step in (1, 2):
        assert metrics[step]["judge/n_scored"] == metrics[step]["training/n_calls"] > 0
        assert metrics[step]["judge/n_failed"] + metrics[step]["judge/n_garbage"] == 0
        assert metrics[step]["advantage/rollouts_outcome_only"] == 0  # every rollout's calls have their own
        assert metrics[step]["advantage/calls"] == metrics[step]["training/n_calls"]
