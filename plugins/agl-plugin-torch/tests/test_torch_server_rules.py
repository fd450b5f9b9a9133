"""The policy endpoint keeps the rules of every server: a token off loopback, bounded bodies, a bare health check."""

import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import openai
import pytest
from openai import OpenAI

from agl_core.http.rules import POLICY_TOKEN_ENV
from agl_plugin_torch.backend import create
from agl_plugin_torch.settings import TorchConfig
from agl_plugin_torch.testing import tiny_section

MESSAGES = [{"role": "user", "content": "guess a number"}]
CHAT = {"model": "policy", "messages": MESSAGES, "max_tokens": 2}


@pytest.fixture
def serve(tmp_path, monkeypatch):
    """``serve(**serving)``: a backend over the tiny model, its endpoint started with these serving settings."""
    monkeypatch.delenv(POLICY_TOKEN_ENV, raising=False)
    started = []

    def start(**serving):
        config = TorchConfig.model_validate(tiny_section(serving=serving))
        backend = create(config, tmp_path / f"run{len(started)}", seed=0, with_critic=False)
        started.append(backend)
        backend.start_serving("policy")
        return backend

    yield start
    for backend in started:
        backend.stop_serving()


def local_url(backend) -> str:
    """The endpoint's root URL on 127.0.0.1 (also when it binds every address)."""
    return f"http://127.0.0.1:{urlsplit(backend.url).port}"


def test_a_bind_off_loopback_without_a_token_is_refused_at_start_up(serve):
    with pytest.raises(ValueError, match=r"plugins\.torch\.serving\.token"):
        serve(host="0.0.0.0")


def test_the_token_from_the_environment_guards_every_endpoint_but_a_bare_health_check(serve, monkeypatch):
    monkeypatch.setenv(POLICY_TOKEN_ENV, "s3cret")
    root = local_url(serve(host="0.0.0.0"))
    for method, path, body in [("POST", "/v1/chat/completions", CHAT), ("GET", "/v1/models", None),
                               ("POST", "/v1/completions", {"prompt": "hello", "max_tokens": 2})]:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
            reply = httpx.request(method, root + path, json=body, headers=headers, timeout=30)
            assert reply.status_code == 401, (path, headers)
            assert "bearer token" in reply.json()["error"]["message"]
    assert httpx.get(root + "/healthz", timeout=30).json() == {"ok": True}
    assert httpx.get(root + "/health", headers={"authorization": "Bearer s3cret"},
                     timeout=30).json() == {"ok": True, "weight_version": 0}
    client = OpenAI(base_url=root + "/v1", api_key="s3cret", max_retries=0, timeout=30)
    assert client.chat.completions.create(**CHAT).choices[0].model_extra["token_ids"]
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=root + "/v1", api_key="other", max_retries=0, timeout=30).chat.completions.create(**CHAT)


def test_the_recipe_token_wins_over_the_environment(serve, monkeypatch):
    monkeypatch.setenv(POLICY_TOKEN_ENV, "from-env")
    root = local_url(serve(token="from-recipe"))
    assert httpx.get(root + "/v1/models", headers={"authorization": "Bearer from-env"},
                     timeout=30).status_code == 401
    assert httpx.get(root + "/v1/models", headers={"authorization": "Bearer from-recipe"},
                     timeout=30).status_code == 200


def test_without_a_token_the_health_check_shows_the_weight_version(serve):
    assert httpx.get(local_url(serve()) + "/healthz", timeout=30).json() == {"ok": True, "weight_version": 0}


def test_a_body_over_the_limit_is_a_413_whether_declared_or_streamed(serve):
    root = local_url(serve(max_body_bytes=1024))
    padded = {**CHAT, "user": "x" * 2048}
    declared = httpx.post(root + "/v1/chat/completions", json=padded, timeout=30)

    def chunks():  # no Content-Length: the limit holds while the body streams in
        for _ in range(8):
            yield b" " * 512

    streamed = httpx.post(root + "/v1/chat/completions", content=chunks(),
                          headers={"content-type": "application/json"}, timeout=30)
    for reply in (declared, streamed):
        assert reply.status_code == 413
        assert "plugins.torch.serving.max_body_bytes" in reply.json()["error"]["message"]
    assert httpx.post(root + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200


def test_serving_settings_are_checked():
    with pytest.raises(ValueError, match="max_body_bytes"):
        TorchConfig.model_validate(tiny_section(serving={"max_body_bytes": 10}))
    with pytest.raises(ValueError, match="body_timeout_s"):
        TorchConfig.model_validate(tiny_section(serving={"body_timeout_s": 0}))


def test_a_serving_token_the_gateway_does_not_send_is_refused_at_start_up(tmp_path, monkeypatch):
    """Through the real ``agl train``: every call would get 401, so the run does not start."""
    monkeypatch.delenv(POLICY_TOKEN_ENV, raising=False)
    root = Path(__file__).resolve().parents[3]
    exe = shutil.which("agl") or str(Path(sys.executable).with_name("agl"))
    out = subprocess.run([exe, "train", root / "examples" / "guess_number" / "recipe.yaml",
                          f"trainer.run_dir={tmp_path / 'run'}", "plugins.torch.serving.token=s3cret"],
                         capture_output=True, text=True, cwd=root, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert ("agl: error: plugins.torch.serving.token is not the token the gateway sends its policy servers "
            "(rollout.gateway.upstream_token)") in out.stderr
