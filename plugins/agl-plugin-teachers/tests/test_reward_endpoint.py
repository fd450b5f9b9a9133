"""A reward model behind an endpoint: the tiny sequence-classification model of test_reward_model served on
127.0.0.1 by agl_plugin_teachers.reward_server (vLLM's pooling API), its values equal to the local reward model's,
per rollout and per turn, batched and concurrent; a server that fails or answers garbage marks the rollouts."""

from __future__ import annotations

import json

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

from agl_core.http.server import ServerThread
from agl_core.testing.endpoint import ByteTokenizer
from agl_plugin_teachers.judge import build_judge
from agl_plugin_teachers.reward_model import RewardModel, pooled_values, pooling_url
from agl_plugin_teachers.reward_server import serve_reward_model
from agl_plugin_teachers.settings import JudgeConfig
from agl_plugin_teachers.verdicts import Transcript

from runs import logged, recipe_file, train
from test_reward_model import alone, check_rewards_per_rollout_and_per_turn, reward_model, rollout  # noqa: F401


@pytest.fixture
def served(reward_model):  # noqa: F811
    server = serve_reward_model(str(reward_model), rows_per_forward=3)
    yield server
    server.stop()


def endpoint_judge(url, tokenizer, **settings):
    return build_judge(JudgeConfig(kind="reward_model", endpoint=url + "/v1", model="reward", **settings), tokenizer)


def test_the_endpoints_values_are_the_local_models(served, reward_model, backend):  # noqa: F811
    rows = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [4], [9, 9, 9, 5, 6], [7, 7, 7, 7, 7, 7, 7, 7, 7]]
    transcripts = [Transcript(f"r{i}", "t", None, ids) for i, ids in enumerate(rows)]
    judge = endpoint_judge(served.url, backend.tokenizer, rows_per_forward=2, concurrency=2)
    try:
        remote = judge.scorer.score(transcripts, {})
    finally:
        judge.close()
    local = RewardModel(JudgeConfig(kind="reward_model", model_path=str(reward_model)), backend.tokenizer)
    expected = [v.score for v in local.score(transcripts, {})]
    assert [v.score for v in remote] == pytest.approx(expected, abs=1e-5)
    assert expected == pytest.approx([alone(reward_model, ids) for ids in rows], abs=1e-5)
    assert [v.prompt_tokens for v in remote] == [len(ids) for ids in rows]


def test_a_text_is_read_with_the_models_tokenizer(served, reward_model, backend):  # noqa: F811
    text = "guess 3 higher"
    reply = httpx.post(served.url + "/pooling", json={"model": "reward", "input": [text, [5, 6]]}).json()
    ids = backend.tokenizer(text, add_special_tokens=True)["input_ids"]
    assert pooled_values(reply, 2) == pytest.approx([alone(reward_model, ids), alone(reward_model, [5, 6])], abs=1e-5)
    assert reply["usage"]["prompt_tokens"] == len(ids) + 2
    bad = httpx.post(served.url + "/pooling", json={"model": "reward", "input": [[5, 10 ** 6]]})
    assert bad.status_code == 400 and "input[0]" in bad.text


def test_per_rollout_and_per_turn_through_the_endpoint_cached(served, reward_model, backend):  # noqa: F811
    check_rewards_per_rollout_and_per_turn(reward_model, lambda **settings: endpoint_judge(
        served.url, backend.tokenizer, **settings))


def test_another_tokenizer_gets_the_transcript_rendered_as_the_local_model_does(served, reward_model):  # noqa: F811
    transcripts = [Transcript("r", "t", None, ByteTokenizer().encode("guess 3 higher guess 5"))]
    judge = endpoint_judge(served.url, ByteTokenizer(), reward_tokenizer=str(reward_model), max_length=20)
    try:
        [remote] = judge.scorer.score(transcripts, {"t": {"secret": 5}})
        assert not judge.scorer.same_tokens
    finally:
        judge.close()
    local = RewardModel(JudgeConfig(kind="reward_model", model_path=str(reward_model), max_length=20), ByteTokenizer())
    [expected] = local.score(transcripts, {"t": {"secret": 5}})
    assert remote.score == pytest.approx(expected.score, abs=1e-5)


@pytest.fixture
def broken():
    """A server on 127.0.0.1 answering /pooling with what the test sets: a status and a body; counts requests."""
    state = {"status": 500, "body": {"error": {"message": "down"}}, "requests": 0}

    async def pooling(request):
        state["requests"] += 1
        body = state["body"]  # a text as it is: JSON with NaN, which JSONResponse refuses to write
        return Response(body if isinstance(body, str) else json.dumps(body), state["status"],
                        media_type="application/json")

    server = ServerThread(Starlette(routes=[Route("/pooling", pooling, methods=["POST"])])).start()
    state["url"] = server.url
    yield state
    server.stop()


def test_a_failing_endpoint_marks_the_rollouts_after_its_retries(broken, backend):
    judge = endpoint_judge(broken["url"], backend.tokenizer, max_retries=1, rows_per_forward=1)
    try:
        judged, metrics = judge.judge([rollout("a", [([5], [6])]), rollout("b", [([5], [7])])], {})
    finally:
        judge.close()
    assert broken["requests"] == 4  # each of the two requests tried twice
    assert metrics["judge/n_failed"] == 2 and [r.status for r in judged] == ["failed", "failed"]
    assert "reward model 'reward' at http://" in judged[0].error and judged[0].final_reward == 1.0


@pytest.mark.parametrize("body", [{"data": []}, {"data": [{"index": 0, "data": "high"}]}, {"nothing": 1},
                                  '{"data": [{"index": 0, "data": [NaN]}]}'])
def test_garbage_answers_mark_the_rollout_or_turn(broken, backend, body):
    broken.update(status=200, body=body)
    judge = endpoint_judge(broken["url"], backend.tokenizer, per="turn")
    try:
        [judged], metrics = judge.judge([rollout("a", [([5], [6])])], {})
    finally:
        judge.close()
    assert metrics["judge/n_garbage"] == 1 and metrics["judge/n_scored"] == 0
    assert judged.status == "failed" and "judge: no turn judged" in judged.error


def test_pooled_values_read_vllms_shapes():
    assert pooled_values({"data": [{"index": 1, "data": [2.0]}, {"index": 0, "data": 1}]}, 2) == [1.0, 2.0]
    assert pooled_values({"data": [{"index": 0, "data": [[0.1], [0.2], [0.3]]}]}, 1) == [0.3]  # per token: last
    assert pooling_url("http://h:1/v1/") == "http://h:1/pooling" and pooling_url("http://h:1") == "http://h:1/pooling"


def test_a_run_scored_by_a_reward_model_behind_an_endpoint(tmp_path, served):
    path = recipe_file(tmp_path, trainer={"run_dir": str(tmp_path / "judged")}, plugins={
        "judge": {"kind": "reward_model", "endpoint": served.url + "/v1", "model": "reward"}})
    metrics = logged(train(path, ["judge"]).ctx.run_dir)
    for step in (1, 2):
        assert metrics[step]["judge/n_scored"] == 4 and metrics[step]["judge/n_failed"] == 0
        assert metrics[step].get("training/skipped_step", 0.0) == 0.0 and "actor/pg_loss" in metrics[step]
