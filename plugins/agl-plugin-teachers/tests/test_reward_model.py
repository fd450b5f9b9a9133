"""The reward model with a value head: a tiny llama sequence-classification model made from the policy's config
(num_labels 1, random weights) and saved to a directory, scoring transcripts in padded batches exactly as it scores
each alone, its values replacing or adding to the rewards, per rollout and per turn, and a whole run."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from agl_core.data import Rollout, Span
from agl_core.testing.endpoint import ByteTokenizer
from agl_plugin_teachers.judge import build_judge
from agl_plugin_teachers.reward_model import RewardModel
from agl_plugin_teachers.settings import JudgeConfig
from agl_plugin_teachers.verdicts import Transcript
from agl_plugin_traces.trajectory import trajectory_batch

from runs import logged, recipe_file, train


@pytest.fixture
def reward_model(tmp_path, backend):
    """A sequence-classification model of the policy's architecture and tokenizer, saved as a model directory."""
    settings = {k: v for k, v in backend.actor.config.to_dict().items() if k not in ("id2label", "label2id")}
    config = backend.actor.config.__class__.from_dict({**settings, "num_labels": 1})
    torch.manual_seed(1)
    model = AutoModelForSequenceClassification.from_config(config)
    torch.nn.init.normal_(model.score.weight, std=1.0)  # values of order 1, unlike each other
    path = tmp_path / "rm"
    model.save_pretrained(path)
    backend.tokenizer.save_pretrained(path)
    return path


def alone(path, ids) -> float:
    """The model's own value of one unpadded sequence: transformers' forward, pooled by itself."""
    model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True).eval()
    with torch.no_grad():
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])


def rollout(rollout_id, calls: list[tuple[list[int], list[int]]], reward=1.0) -> Rollout:
    return Rollout(rollout_id=rollout_id, task_id="t", status="succeeded", final_reward=reward, spans=[
        Span(rollout_id=rollout_id, sequence_id=i, kind="llm_call", prompt_token_ids=p, response_token_ids=r)
        for i, (p, r) in enumerate(calls)])


def test_batched_values_are_each_transcripts_own(reward_model, backend):
    config = JudgeConfig(kind="reward_model", model_path=str(reward_model), rows_per_forward=3)
    rm = RewardModel(config, backend.tokenizer)
    assert rm.same_tokens  # the policy's tokenizer: the transcripts' own ids are scored
    rows = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [4], [9, 9, 9, 5, 6], [7, 7, 7, 7, 7, 7, 7, 7, 7]]
    verdicts = rm.score([Transcript(f"r{i}", "t", None, ids) for i, ids in enumerate(rows)], {})
    expected = [alone(reward_model, ids) for ids in rows]
    assert [v.score for v in verdicts] == pytest.approx(expected, abs=1e-5)
    assert len(set(round(v, 4) for v in expected)) == len(rows)  # the values tell the rows apart
    assert [v.prompt_tokens for v in verdicts] == [len(ids) for ids in rows]


def test_another_tokenizer_reads_the_transcript_rendered_by_its_chat_template(reward_model, backend):
    """The policy's tokenizer here is the test endpoint's byte tokenizer: the transcript's text is re-tokenized."""
    config = JudgeConfig(kind="reward_model", model_path=str(reward_model), max_length=20)
    rm = RewardModel(config, ByteTokenizer())
    assert not rm.same_tokens
    text = "guess 3 higher guess 5"
    [verdict] = rm.score([Transcript("r", "t", None, ByteTokenizer().encode(text))], {"t": {"secret": 5}})
    rendered = backend.tokenizer.apply_chat_template(
        [{"role": "user", "content": '{"secret": 5}'}, {"role": "assistant", "content": text}], tokenize=True,
        return_dict=False)
    assert verdict.score == pytest.approx(alone(reward_model, list(rendered)[-20:]), abs=1e-5)


def check_rewards_per_rollout_and_per_turn(reward_model, judge_with) -> None:
    """The values of a two-call rollout's transcripts replace (per rollout, cached) or add to (per turn) its rewards;
    ``judge_with(**settings)`` builds the judge under test."""
    calls = [([5, 6], [7, 8]), ([5, 6, 7, 8, 9], [10])]
    value_0, value_1 = alone(reward_model, [5, 6, 7, 8]), alone(reward_model, [5, 6, 7, 8, 9, 10])
    judge = judge_with(weight=0.5)
    try:
        [judged], metrics = judge.judge([rollout("a", calls)], {})
        assert judged.final_reward == pytest.approx(0.5 * value_1, abs=1e-5)  # the last call: the whole conversation
        assert metrics["judge/n_scored"] == 1 and metrics["judge/prompt_tokens"] == 6
        [again], metrics = judge.judge([rollout("a", calls)], {})
        assert metrics["judge/cache_hits"] == 1 and again.final_reward == judged.final_reward
    finally:
        judge.close()
    judge = judge_with(per="turn", mode="add")
    try:
        [judged], _ = judge.judge([rollout("a", calls, reward=1.0)], {})
    finally:
        judge.close()
    batch, _, _ = trajectory_batch([judged], 20, 20)
    assert batch["call_rewards"].tolist() == [pytest.approx([value_0, 1.0 + value_1], abs=1e-5)]
    assert batch["call_reward_sources"].tolist() == [["judge", "judge"]]


def test_values_replace_or_add_per_rollout_and_per_turn_cached(reward_model, backend):
    check_rewards_per_rollout_and_per_turn(reward_model, lambda **settings: build_judge(
        JudgeConfig(kind="reward_model", model_path=str(reward_model), **settings), backend.tokenizer))


def test_a_reward_model_that_fails_marks_the_rollouts(reward_model, backend):
    judge = build_judge(JudgeConfig(kind="reward_model", model_path=str(reward_model)), backend.tokenizer)
    try:
        judged, metrics = judge.judge([rollout("a", [([5], [10 ** 6])]), rollout("b", [([5], [6])])], {})
    finally:
        judge.close()
    # one forward pass for both: the id past the vocabulary fails it, and both are marked, never scored 0
    assert metrics["judge/n_failed"] == 2 and [r.status for r in judged] == ["failed", "failed"]
    assert "reward model at model_path=" in judged[0].error and judged[0].final_reward == 1.0


def test_settings_name_what_a_reward_model_needs(tmp_path, reward_model, backend):
    with pytest.raises(ValueError, match="reward_tokenizer names the tokenizer of a reward model behind an endpoint"):
        JudgeConfig(kind="reward_model", model_path=str(reward_model), reward_tokenizer=str(reward_model))
    assert JudgeConfig(kind="reward_model", endpoint="http://127.0.0.1:1/v1").scale == 1.0
    assert JudgeConfig(kind="reward_model", model_path=str(reward_model)).scale == 1.0
    assert JudgeConfig(endpoint="http://127.0.0.1:1/v1").scale == 0.1
    two_labels = AutoModelForSequenceClassification.from_pretrained(reward_model, num_labels=2,
                                                                    ignore_mismatched_sizes=True)
    two_labels.save_pretrained(tmp_path / "classifier")
    backend.tokenizer.save_pretrained(tmp_path / "classifier")
    with pytest.raises(ValueError, match="has a head of 2 labels; a reward model gives one value"):
        RewardModel(JudgeConfig(kind="reward_model", model_path=str(tmp_path / "classifier")), backend.tokenizer)


def test_a_run_scored_by_a_reward_model(tmp_path, reward_model):
    path = recipe_file(tmp_path, plugins={"judge": {"kind": "reward_model", "model_path": str(reward_model)}},
                       trainer={"run_dir": str(tmp_path / "judged")})
    metrics = logged(train(path, ["judge"]).ctx.run_dir)
    for step in (1, 2):
        assert metrics[step]["judge/n_scored"] == 4 and metrics[step]["judge/n_failed"] == 0
        assert metrics[step].get("training/skipped_step", 0.0) == 0.0 and "actor/pg_loss" in metrics[step]
