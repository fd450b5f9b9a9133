"""On-policy distillation: the teacher stage over real HTTP (the embedded backend serving a checkpoint, and
the test endpoint for failures), the estimator on hand-computed cases."""

from __future__ import annotations

import base64
import math

import numpy as np
import pytest
import torch

from agl_core.testing.endpoint import ByteTokenizer, response_logprob
from agl_plugin_teachers.distill_math import reverse_kl, reverse_kl_advantages
from agl_plugin_teachers.endpoints import Served, tokenizer_fingerprint
from agl_plugin_teachers.settings import TeacherConfig
from agl_plugin_teachers.teacher import LocalTeacher, TeacherError, TeacherScorer, row_sequences
from agl_plugin_torch.backend import create
from agl_plugin_torch.settings import TorchConfig
from agl_plugin_torch.testing import VOCABULARY, sampled_rows, tiny_section


def scorer(config: dict, student=None, rows_per_request=4) -> TeacherScorer:
    return TeacherScorer(Served(TeacherConfig(**config), "teacher"), rows_per_request, student)


def test_a_served_checkpoint_scores_exactly_the_log_probs_the_trainer_computes(backend, checkpoint):
    """The teacher is the student's own weights, served by the embedded backend: its log-prob of every sampled
    token equals the trainer's old log-prob of it (same model, same token ids)."""
    batch = sampled_rows(backend, n=10, max_tokens=6)
    teacher = scorer({"model_path": str(checkpoint), "concurrency": 3}, backend.tokenizer)
    mask = batch["response_mask"].bool()
    try:
        # The first batch is answered per token (its texts check the tokenizer), the next ones packed.
        for answer in ("per token", "packed"):
            log_probs, metrics = teacher.score(row_sequences(batch), batch["responses"].shape[1])
            assert torch.allclose(log_probs[mask], batch["old_log_probs"][mask], atol=1e-5), answer
            assert (log_probs[~mask] == 0).all()
            assert metrics["teacher/requests"] == 3 and metrics["teacher/tokens"] == mask.sum()
    finally:
        teacher.close()


def test_a_local_teacher_scores_in_process_exactly_the_log_probs_the_trainer_computes(backend, checkpoint):
    batch = sampled_rows(backend, n=10, max_tokens=6)
    teacher = LocalTeacher(TeacherConfig(model_path=str(checkpoint)), rows_per_forward=4)
    log_probs, metrics = teacher.score_batch(batch)
    mask = batch["response_mask"].bool()
    assert torch.allclose(log_probs[mask], batch["old_log_probs"][mask], atol=1e-6)
    assert (log_probs[~mask] == 0).all() and metrics["teacher/tokens"] == mask.sum()


def test_the_test_endpoint_teachers_log_probs_land_on_each_rows_response(endpoint):
    """Rows of different prompt and response lengths: each response token gets the log-prob of its position."""
    sequences = [([5, 6, 7, 8, 9], 2), ([10, 11, 12, 15], 3), ([13, 14], 1)]
    teacher = scorer({"endpoint": endpoint.url}, rows_per_request=2)
    try:
        log_probs, _ = teacher.score(sequences, 4)
    finally:
        teacher.close()
    for row, (ids, n) in enumerate(sequences):
        expected = [response_logprob(ids[p], p) for p in range(len(ids) - n, len(ids))]
        assert log_probs[row, :n].tolist() == pytest.approx(expected)
        assert (log_probs[row, n:] == 0).all()
    assert sorted(len(r["prompt"]) for r in endpoint.requests) == [1, 2]  # concurrent: in any order
    assert all(r["prompt_logprobs"] == 0 for r in endpoint.requests)


def test_a_failing_teacher_is_retried_then_fails_the_step_naming_it(endpoint):
    endpoint.fail_next.extend([503])
    teacher = scorer({"endpoint": endpoint.url, "max_retries": 2, "model": "big-teacher"})
    try:
        log_probs, _ = teacher.score([([5, 6, 7], 1)], 1)  # one 503, then a retry that succeeds
        assert log_probs[0, 0].item() == pytest.approx(response_logprob(7, 2))
        endpoint.fail_next.extend([500, 500, 500])
        with pytest.raises(TeacherError, match="teacher 'big-teacher' at http://127.0.0.1.*after 2 retries"):
            teacher.score([([5, 6, 7], 1)], 1)
    finally:
        teacher.close()


def test_a_teacher_slower_than_its_time_limit_fails_the_step(endpoint):
    endpoint.delay_s = 2.0
    teacher = scorer({"endpoint": endpoint.url, "timeout_s": 0.3, "max_retries": 0})
    try:
        with pytest.raises(TeacherError, match="failed to score 1 rows.*timed out"):
            teacher.score([([5, 6, 7], 1)], 1)
    finally:
        teacher.close()


def test_a_teacher_that_does_not_score_given_tokens_is_refused(endpoint):
    """An endpoint that ignores prompt_logprobs (an API model) answers without them: a clear error."""
    teacher = scorer({"endpoint": endpoint.url})
    # What a server without the extension answers:
    teacher._request = lambda chunk, packed: [{"index": 0, "text": "hello"}]
    try:
        with pytest.raises(TeacherError, match="does not score given tokens"):
            teacher.score([([5, 6, 7], 1)], 1)
    finally:
        teacher.close()


def test_packed_log_probs_that_do_not_fit_the_row_fail_the_step(endpoint):
    """A packed answer (the embedded endpoint's extension) that is not base64 float32, or holds a log-prob count
    other than one per token after the first: a clear error naming the teacher and the row."""
    teacher = scorer({"endpoint": endpoint.url, "model": "big-teacher"})
    good = base64.b64encode(np.array([-0.5, -0.25], dtype="<f4").tobytes()).decode()
    try:
        teacher._request = lambda chunk, packed: [{"index": 0, "packed_prompt_logprobs": good}]
        log_probs, _ = teacher.score([([5, 6, 7], 1)], 1)
        assert log_probs.tolist() == [[-0.25]]  # the last token's: one per token after the first
        for answer, message in (("not base64!", "not base64 float32"), (good[:-4], "not base64 float32"),
                                (base64.b64encode(np.zeros(5, dtype="<f4").tobytes()).decode(),
                                 "row 0 with 5 packed log-probs for 3 tokens")):
            teacher._request = lambda chunk, packed, answer=answer: [{"index": 0, "packed_prompt_logprobs": answer}]
            with pytest.raises(TeacherError, match=f"teacher 'big-teacher'.*{message}"):
                teacher.score([([5, 6, 7], 1)], 1)
    finally:
        teacher.close()


def test_a_teacher_with_another_tokenizer_is_refused(tmp_path, endpoint, backend):
    """At start-up by vocabulary hash; at run time (an endpoint with no tokenizer given) by how it decodes ids."""
    other = create(TorchConfig.model_validate(tiny_section(model={"build": {"vocabulary": VOCABULARY[::-1],
                                                                             "hidden_size": 32, "num_heads": 2}})),
                   tmp_path / "other", seed=0, with_critic=False)
    assert tokenizer_fingerprint(other.tokenizer) != tokenizer_fingerprint(backend.tokenizer)
    assert tokenizer_fingerprint(other.tokenizer) == tokenizer_fingerprint(other.tokenizer)
    teacher = scorer({"endpoint": endpoint.url}, student=backend.tokenizer)  # the test endpoint's bytes
    try:
        with pytest.raises(TeacherError, match="different tokenizers"):
            teacher.score([([30, 31, 32], 2)], 2)
    finally:
        teacher.close()
    assert ByteTokenizer().token_text(31) != backend.tokenizer.decode([31])


def test_reverse_kl_advantages_by_hand():
    teacher = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-0.1, -0.2, -0.3, -0.4]])
    student = torch.tensor([[-1.5, -1.0, -0.5, -9.0], [-0.3, -0.2, -0.1, -0.4]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]])
    torch.testing.assert_close(reverse_kl_advantages(teacher, student, mask),
                               torch.tensor([[0.5, -1.0, 0.0, 0.0], [0.2, 0.0, -0.2, 0.0]]))
    # discount 0.5: A_t = d_t + 0.5 A_{t+1} over masked tokens only (the masked hole neither adds nor decays)
    torch.testing.assert_close(reverse_kl_advantages(teacher, student, mask, discount=0.5),
                               torch.tensor([[0.5 + 0.5 * (-1.0), -1.0, 0.0, 0.0], [0.2 + 0.5 * (-0.2), 0.0, -0.2, 0.0]]))
    # KL(student || teacher) per token: mean of student - teacher over the 6 response tokens
    assert reverse_kl(teacher, student, mask) == pytest.approx((-0.5 + 1.0 + 0 - 0.2 + 0.2 + 0) / 6)
    assert math.isclose(reverse_kl(teacher, teacher, mask), 0.0)


def test_the_embedded_endpoints_scoring_route_checks_its_requests(checkpoint):
    """Bad scoring requests are a 400 naming the field; a list of prompts gets a choice each."""
    import httpx

    served = Served(TeacherConfig(model_path=str(checkpoint)), "teacher")
    try:
        url = served.url + "/completions"
        for body, field in (({"prompt": [5, 6], "prompt_logprobs": -1}, "'prompt_logprobs'"),
                            ({"prompt": [5, 6], "prompt_logprobs": True}, "'prompt_logprobs'"),
                            ({"prompt": [[5, 6], []], "prompt_logprobs": 0}, "'prompt[1]'"),
                            ({"prompt": [5, 10**6], "prompt_logprobs": 0}, "'prompt' token ids"),
                            ({"prompt": [[1] * 65], "prompt_logprobs": 0}, "65 tokens")):
            reply = httpx.post(url, json=body, timeout=30)
            assert reply.status_code == 400 and field in reply.json()["error"]["message"], (body, reply.text)
        reply = httpx.post(url, json={"prompt": [[5, 6, 7], [8, 9]], "prompt_logprobs": 2}, timeout=30).json()
        first, second = reply["choices"]
        assert first["prompt_logprobs"][0] is None and len(first["prompt_logprobs"]) == 3
        assert len(second["prompt_logprobs"]) == 2 and second["prompt_token_ids"] == [8, 9]
        entry = first["prompt_logprobs"][1]
        assert "6" in entry and 1 <= entry["6"]["rank"] and len(entry) <= 3  # the token and 2 alternatives
        assert reply["usage"] == {"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5}
        # Packed: the same log-probs, as base64 float32, one per token after the first.
        for body, field in (({"prompt": [5, 6], "prompt_logprobs": 1, "packed_prompt_logprobs": True},
                             "'prompt_logprobs': 0"),
                            ({"prompt": [5, 6], "prompt_logprobs": 0, "packed_prompt_logprobs": "yes"},
                             "'packed_prompt_logprobs'")):
            reply = httpx.post(url, json=body, timeout=30)
            assert reply.status_code == 400 and field in reply.json()["error"]["message"], (body, reply.text)
        prompts = [[5, 6, 7], [8, 9]]
        per_token = httpx.post(url, json={"prompt": prompts, "prompt_logprobs": 0}, timeout=30).json()["choices"]
        packed = httpx.post(url, json={"prompt": prompts, "prompt_logprobs": 0, "packed_prompt_logprobs": True},
                            timeout=30).json()["choices"]
        for ids, dicts, choice in zip(prompts, per_token, packed):
            values = np.frombuffer(base64.b64decode(choice["packed_prompt_logprobs"]), dtype="<f4")
            expected = [dicts["prompt_logprobs"][p][str(ids[p])]["logprob"] for p in range(1, len(ids))]
            assert values.tolist() == pytest.approx(expected, abs=1e-6) and "prompt_logprobs" not in choice
    finally:
        served.close()
