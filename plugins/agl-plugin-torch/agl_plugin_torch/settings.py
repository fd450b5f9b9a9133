"""The recipe section ``plugins.torch``: which model, how it is served, how actor and critic learn."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

NAME = "torch"
"""The plugin's name: its recipe section ``plugins.torch`` and its key in ``ctx.state``."""

LOSS_COLUMNS = ("rollout_is_weights", "sft_mask")
"""Per-token columns passed to the policy loss by name when the batch has them: the off-policy correction's
weights, and the rows an SFT loss trains on (agl-plugin-teachers)."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BuildConfig(_Section):
    """A small causal LM made from a config, with a word-level tokenizer over ``vocabulary``."""

    architecture: Literal["llama", "qwen2"] = Field(
        "llama", description="transformers config class; a made qwen2 model's tokenizer must be reloaded with "
                             "PreTrainedTokenizerFast (AutoTokenizer swaps in Qwen2's)")
    vocabulary: list[str] = Field(min_length=1, description="the words of the tokenizer (special tokens are added)")
    hidden_size: int = Field(64, ge=8)
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int | None = Field(None, ge=1, description="key/value heads, grouped-query attention "
                                                             "(None: num_heads)")
    vocab_size: int | None = Field(None, ge=1, description="rows of the embedding and the output layer, at least "
                                   "the tokenizer's (None: the tokenizer's size); a larger one gives a made model "
                                   "a real model's shape (151936 for Qwen2's), its extra tokens decode to nothing")
    intermediate_size: int | None = Field(None, ge=8, description="MLP width (None: 4 * hidden_size)")
    max_position_embeddings: int = Field(256, ge=8, description="longest prompt + response the model takes")
    init_std: float = Field(0.02, gt=0, description="standard deviation of the initial weights")

    @model_validator(mode="after")
    def _heads_divide_width(self) -> BuildConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}")
        if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        return self


class ModelConfig(_Section):
    """Where the policy comes from: a local Hugging Face directory (``path``) or a config (``build``)."""

    path: str | None = Field(None, description="local directory of a Hugging Face causal LM and its tokenizer")
    build: BuildConfig | None = Field(None, description="make a randomly initialised model instead")
    attention: Literal["auto", "sdpa", "flash_attention_2", "eager"] = Field(
        "auto", description="attention kernel (transformers' attn_implementation); auto: on a GPU flash_attention_2 "
                            "when the flash_attn package is importable, else sdpa; on a CPU transformers' default")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="weights dtype; auto: bfloat16 on a GPU that supports it, float32 otherwise")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available")

    def on_cuda(self) -> bool:
        """Whether the model goes to a GPU: ``device: cuda``, or ``auto`` on a machine that has one."""
        import torch  # here: reading a recipe (``agl plugins``, ``agl check``) needs no torch

        return self.device == "cuda" or (self.device == "auto" and torch.cuda.is_available())

    @field_validator("path")
    @classmethod
    def _path_exists(cls, path: str | None) -> str | None:
        # Checked here so that a wrong path is one clear error at start-up, never a hub download attempt.
        if path is not None and not (Path(path) / "config.json").is_file():
            what = "does not exist" if not Path(path).exists() else "has no config.json"
            raise ValueError(f"model directory {path!r} {what}; give a local Hugging Face model directory")
        return path

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.path is None) == (self.build is None):
            raise ValueError("set exactly one of model.path (a local model directory) and model.build "
                             "(a small model made from a config)")
        return self


class OptimConfig(_Section):
    """AdamW with linear warm-up, then a constant learning rate."""

    lr: float = Field(1e-6, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(0.01, ge=0)
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warm-up from 0 to lr")
    grad_clip: float = Field(1.0, gt=0, description="max global gradient norm")
    micro_batch_size: int | None = Field(None, ge=1, description="rows per forward/backward (None: the whole "
                                                                 "mini-batch); gradients are accumulated")


class CriticConfig(OptimConfig):
    """The critic: the policy's backbone with a scalar head, trained with the clipped value loss."""

    lr: float = Field(1e-5, gt=0)
    cliprange_value: float = Field(0.5, ge=0, description="how far a value may move from its old estimate")


class ServingConfig(_Section):
    """The OpenAI-compatible endpoint agents (through the gateway) call."""

    host: str = Field("127.0.0.1", description="address to bind; anything but loopback requires a token")
    port: int = Field(0, ge=0, le=65535, description="0: a free port chosen by the OS")
    token: str | None = Field(None, description="bearer token callers must send (default: $AGL_POLICY_TOKEN, "
                                                "which the gateway sends too); required when host is not a "
                                                "loopback address")
    max_body_bytes: int = Field(8 * 2**20, ge=1024, description="larger request bodies are refused with 413")
    body_timeout_s: float = Field(30.0, gt=0, description="time a client may take to send a request body; "
                                                          "a slower one is answered 408")
    max_connections: int = Field(1024, ge=1, description="connections the endpoint holds at once; one more is "
                                                         "answered 503 and closed")
    max_batch_rows: int = Field(256, ge=1, description="most sequences generated together; also the most "
                                                       "choices (n) one request may ask for")
    batch_wait_ms: float = Field(2.0, ge=0, description="after a request arrives, wait this long for others "
                                                        "to join its batch (each new one restarts the wait)")
    default_max_tokens: int = Field(256, ge=1, description="response limit of a request that sets none")
    kv_cache: Literal["dynamic", "static"] = Field(
        "dynamic", description="dynamic: the KV cache grows a token at a time; static: it is allocated whole for "
                               "each batch (prompt + longest response) on the model's device, every decode step "
                               "of the batch then has one shape")
    compile_decode: bool = Field(False, description="run the decode steps through torch.compile(mode="
                                 "'reduce-overhead'), CUDA graphs on a GPU: needs kv_cache: static; each new batch "
                                 "shape compiles once (seconds to a minute), so it pays off on long runs")
    process: bool = Field(True, description="on a CPU, serve from a process of its own (over the same weights in "
                          "shared memory), so that generation does not wait for the trainer's interpreter lock, "
                          "which the rollout plane's threads hold; the process is started by multiprocessing, so a script that trains "
                          "must guard its entry point with `if __name__ == '__main__'`")


    @model_validator(mode="after")
    def _compiled_decode_needs_a_static_cache(self) -> ServingConfig:
        if self.compile_decode and self.kv_cache != "static":
            raise ValueError("serving.compile_decode needs serving.kv_cache: static (a compiled step needs "
                             "shapes that do not grow)")
        return self


class TorchConfig(_Section):
    """The section ``plugins.torch``."""

    model: ModelConfig
    actor: OptimConfig = Field(default_factory=OptimConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    serving: ServingConfig = Field(default_factory=ServingConfig)
    forward_micro_batch_size: int = Field(64, ge=1, description="rows per forward pass of log-prob/value "
                                                                "computation")
    num_threads: int | None = Field(None, ge=1, description="torch CPU threads (None: torch's default)")
    update_process: bool = Field(True, description="in asynchronous training on a CPU, compute log-probs and "
                                 "update in a process of their own (over the same weights in shared memory), so "
                                 "the update does not take turns with the rollout plane on the trainer's "
                                 "interpreter lock; the process is started by multiprocessing, so a script that trains must guard "
                                 "its entry point with `if __name__ == '__main__'`)")
    update_process_nice: int = Field(10, ge=0, le=19, description="how much lower the update process's "
                                     "scheduling priority is (POSIX nice): the rollout plane, whose waits lengthen "
                                     "every step, gets the cores first, and the update, hidden behind generation, "
                                     "takes the idle ones; 0 keeps the trainer's priority")

    def serves_in_a_process(self) -> bool:
        """Whether the policy endpoint serves from a process of its own (``serving.process``, on a CPU)."""
        return self.serving.process and not self.model.on_cuda()

    def updates_in_a_process(self, asynchronous: bool) -> bool:
        """Whether the training methods run in a process of their own (``update_process``, asynchronous, on a CPU)."""
        return asynchronous and self.update_process and not self.model.on_cuda()

    def starts_processes(self, asynchronous: bool) -> bool:
        """Whether a run starts worker processes: the serving process or the update process."""
        return self.serves_in_a_process() or self.updates_in_a_process(asynchronous)
