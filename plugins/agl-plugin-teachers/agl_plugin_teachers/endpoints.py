"""Models the plugins call: an OpenAI-compatible endpoint, or a local checkpoint served for the run.

A ``model_path`` is loaded by the embedded backend (agl-plugin-torch) and
served on 127.0.0.1 by its policy endpoint, which answers chat (a judge) and
scoring requests (a teacher) like vLLM does; so every model is reached the
same way, over HTTP, with the real ``openai`` client, its time limit and its
retries.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from agl_plugin_teachers.settings import EndpointConfig

log = logging.getLogger("agl_plugin_teachers")


class Served:
    """A model reached over HTTP: ``client`` (openai), ``url`` and, for a local checkpoint, its ``tokenizer``."""

    def __init__(self, config: EndpointConfig, role: str):
        from openai import OpenAI

        self.config, self.role, self.tokenizer, self._endpoint = config, role, None, None
        url = config.endpoint
        if config.model_path is not None:
            self._endpoint, self.tokenizer = serve_checkpoint(config)
            url = self._endpoint.url + "/v1"
        self.url = url
        self.client = OpenAI(base_url=url, api_key=os.environ.get(config.api_key_env) or "unused",
                             timeout=config.timeout_s, max_retries=config.max_retries)

    def name(self) -> str:
        return f"{self.role} {self.config.model!r} at {self.config.describe()}"

    def close(self) -> None:
        self.client.close()
        if self._endpoint is not None:
            self._endpoint.close()


def serve_checkpoint(config: EndpointConfig):
    """Serve ``config.model_path`` with the embedded backend's endpoint on 127.0.0.1; return it and its tokenizer."""
    try:
        import torch

        from agl_plugin_torch import modeling
        from agl_plugin_torch.backend import eos_token_ids
        from agl_plugin_torch.serving_process import serve_model
        from agl_plugin_torch.settings import ModelConfig, TorchConfig
    except ImportError as exc:
        raise RuntimeError(f"model_path {config.model_path!r} is served by the embedded backend, which is not "
                           f"installed ({exc}); install agl-plugin-torch or give an endpoint") from exc
    section = TorchConfig(model=ModelConfig(path=config.model_path, device=config.device, dtype=config.dtype),
                          serving={"process": False})
    model, tokenizer = modeling.load(Path(config.model_path), section.model)
    model.requires_grad_(False)
    endpoint = serve_model(model, threading.Lock(), lambda: 0, tokenizer, eos_token_ids(model, tokenizer), section,
                           config.model, torch.Generator().manual_seed(0))
    log.info("%s served at %s", config.model_path, endpoint.url)
    return endpoint, tokenizer


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of what makes two tokenizers give the same ids: the vocabulary (token -> id) and special tokens."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    special = sorted(str(t) for t in tokenizer.all_special_tokens)
    return hashlib.sha256(json.dumps([vocab, special]).encode()).hexdigest()[:16]


def load_tokenizer(path: str) -> Any:
    """The tokenizer of a local directory (no download)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception:  # noqa: BLE001 - a word tokenizer made by agl-plugin-torch loads as the generic fast one
        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)


def student_tokenizer(ctx) -> Any | None:
    """The policy's tokenizer when the backend is the embedded one (after its ``on_train_start``), else None."""
    backend = ctx.state.get("torch")
    return getattr(backend, "tokenizer", None)
