"""The recipe sections of the plugins of agl-plugin-teachers: ``plugins.distill``, ``plugins.judge``,
``plugins.sft`` and ``plugins.transcripts``."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EndpointConfig(_Section):
    """A model behind an OpenAI-compatible endpoint, or a local checkpoint the embedded backend serves."""

    endpoint: str | None = Field(None, description="base URL of an OpenAI-compatible server, e.g. "
                                                   "http://127.0.0.1:8000/v1")
    model_path: str | None = Field(None, description="local Hugging Face model directory (e.g. the output of "
                                                     "`agl export RUN_DIR OUT`), served on 127.0.0.1 by the "
                                                     "embedded backend (agl-plugin-torch) for this run")
    model: str = Field("teacher", description="the model name sent with each request")
    api_key_env: str = Field("AGL_TEACHER_API_KEY", description="environment variable holding the bearer "
                                                                 "token to send (none when unset)")
    concurrency: int = Field(4, ge=1, description="requests in flight at once")
    timeout_s: float = Field(120.0, gt=0, description="limit of one request; a slower one is retried")
    max_retries: int = Field(3, ge=0, description="retries of a request that failed with a connection error, "
                                                  "a timeout, 408, 409, 429 or 5xx (the openai client's rule), "
                                                  "with exponential back-off")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="model_path: where the model runs")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="model_path: dtype")

    @model_validator(mode="after")
    def _one_source(self):
        if (self.endpoint is None) == (self.model_path is None):
            raise ValueError("set exactly one of endpoint (an OpenAI-compatible URL) and model_path (a local "
                             "model directory)")
        if self.model_path is not None and not (Path(self.model_path) / "config.json").is_file():
            raise ValueError(f"model_path {self.model_path!r} is not a Hugging Face model directory (no "
                             f"config.json); give a local directory, e.g. one written by `agl export`")
        return self

    def describe(self) -> str:
        return self.endpoint if self.endpoint is not None else f"model_path={self.model_path}"


class TeacherConfig(EndpointConfig):
    """The teacher of on-policy distillation: it scores the student's sampled tokens. A ``model_path`` teacher is
    loaded into the trainer's process (by agl-plugin-torch) and scored there; an endpoint over HTTP."""

    rows_per_request: int = Field(64, ge=1, description="sequences scored by one request (a list of token-id "
                                                        "prompts); a model_path teacher: by one forward pass")
    tokenizer: str | None = Field(None, description="an endpoint teacher's tokenizer directory, compared with "
                                                    "the student's at start-up (a model_path teacher's own is "
                                                    "always compared)")


class DistillConfig(_Section):
    """The section ``plugins.distill``: the teacher and how its log-probs become advantages."""

    teacher: TeacherConfig
    coef: float = Field(1.0, ge=0, description="weight of the per-token advantage teacher - student")
    discount: float = Field(0.0, ge=0, le=1, description="each token's advantage also sums the later tokens' "
                                                         "teacher - student, discounted by this (0: per token, "
                                                         "as on-policy distillation defines it)")
    reward_weight: float = Field(0.0, ge=0, description="weight of the reward's advantages (0: distillation "
                                                        "alone)")
    reward_estimator: str = Field("grpo", description="the estimator of the reward's advantages when "
                                                      "reward_weight > 0")


ROLLOUT_PROMPT = ("You are grading an AI agent's work.\nTask:\n{task}\n\nTranscript:\n{transcript}\n\n"
                  "Rate how well the agent did, from 0 to 10. End your answer with a line `SCORE: <number>`.")
TURN_PROMPT = ("You are grading one step of an AI agent's work.\nTask:\n{task}\n\nTranscript up to the step "
               "(the agent's last message is the step):\n{transcript}\n\nRate how good this step is, from 0 to 10. "
               "End your answer with a line `SCORE: <number>`.")


class JudgeConfig(EndpointConfig):
    """The section ``plugins.judge``: a judge scoring each rollout's transcript, or each turn's. A ``chat`` judge is
    a chat model asked with a prompt (an endpoint, or a ``model_path`` the embedded backend serves); a
    ``reward_model`` is a sequence-classification checkpoint with a value head: ``model_path``, run in the
    trainer's process, or an ``endpoint`` answering vLLM's pooling API."""

    kind: Literal["chat", "reward_model"] = Field(
        "chat", description="chat: a chat model's verdict parsed from its answer; reward_model: the value head of a "
                            "sequence-classification model (num_labels 1): local at model_path, or behind an "
                            "endpoint answering vLLM's pooling API (POST /pooling)")
    per: Literal["rollout", "turn"] = Field(
        "rollout", description="rollout: one score per rollout, into its reward; turn: one score per model call, "
                               "into that call's own reward (the per-call columns the step-level estimators read)")
    turn_transcript: Literal["history", "turn"] = Field(
        "history", description="per turn: the transcript up to and including the turn (history), or the turn alone "
                               "(what is new in its prompt since the previous call, and its response)")
    model: str = Field("judge", description="the model name sent with each request")
    prompt: str | None = Field(None, description="a chat judge's prompt; {task} is the task's input as JSON, "
                                                 "{transcript} the rollout's (or turn's) transcript, {turn} the "
                                                 "turn's position in its trace (default: a grading prompt per "
                                                 "rollout or per turn)")
    verdict_pattern: str = Field(r"SCORE:\s*(-?\d+(?:\.\d+)?)", description="regular expression whose first "
                                 "group is the score; the last match in the answer counts")
    scale: float | None = Field(None, description="the score is multiplied by this (default: 0.1 for a chat judge, "
                                                  "0-10 -> 0-1; 1.0 for a reward model)")
    weight: float = Field(1.0, ge=0, description="weight of the judge's score in the reward")
    mode: Literal["replace", "add"] = Field("replace", description="replace the agent's reward with "
                                            "weight * score, or add weight * score to it")
    max_tokens: int = Field(256, ge=1, description="the judge's answer limit")
    temperature: float = Field(0.0, ge=0)
    transcript_chars: int = Field(20000, ge=100, description="a chat judge's transcript is cut to its last this "
                                                             "many characters")
    max_length: int = Field(4096, ge=2, description="a reward model's input is cut to its last this many tokens")
    rows_per_forward: int = Field(8, ge=1, description="a reward model scores this many transcripts per forward "
                                                            "pass (behind an endpoint: per request)")
    tokenizer: str | None = Field(None, description="the tokenizer directory that decodes the rollouts' token ids "
                                                    "into the transcript (default: the policy's, from plugins.torch)")
    reward_tokenizer: str | None = Field(None, description="a reward model behind an endpoint: its tokenizer "
                                         "directory; another than the policy's gets the transcript re-rendered by "
                                         "it, as a local reward model does (default: it reads the policy's token "
                                         "ids as they are)")

    @model_validator(mode="after")
    def _defaults_by_kind(self):
        if self.reward_tokenizer is not None and (self.kind != "reward_model" or self.endpoint is None):
            raise ValueError("reward_tokenizer names the tokenizer of a reward model behind an endpoint: set it only "
                             "with kind: reward_model and endpoint")
        if self.prompt is None:
            self.prompt = TURN_PROMPT if self.per == "turn" else ROLLOUT_PROMPT
        if self.scale is None:
            self.scale = 0.1 if self.kind == "chat" else 1.0
        return self


class SftConfig(_Section):
    """The section ``plugins.sft``: fine-tune on the rows a filter keeps, alone or beside the PPO loss."""

    min_reward: float | None = Field(None, description="keep a rollout's rows when its reward is at least this "
                                                       "(rejection-sampling fine-tuning); None: keep all")
    coef: float = Field(1.0, ge=0, description="sft_ppo loss: weight of the SFT term beside the PPO loss")


class TranscriptsConfig(_Section):
    """The section ``plugins.transcripts``: an offline dataset of transcripts in place of agents."""

    tokenizer: str | None = Field(None, description="the tokenizer directory whose chat template renders chat "
                                                    "messages (default: the policy's, from plugins.torch)")
    reward: float = Field(1.0, description="the reward of a chat transcript that states none")
    store: str | None = Field(None, description="an earlier run's SQLite store file: a task's transcripts are "
                                                "its rollouts there")
    min_reward: float | None = Field(None, description="store: keep the rollouts with at least this reward")

    @model_validator(mode="after")
    def _store_exists(self):
        if self.store is not None and not Path(self.store).is_file():
            raise ValueError(f"store {self.store!r} is not a file (an earlier run's SQLite store, e.g. "
                             f"runs/NAME/rollouts.sqlite)")
        return self
