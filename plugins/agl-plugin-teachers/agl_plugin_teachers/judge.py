"""Plugin ``judge``: an LLM judge (or any chat model) scores each rollout; the score replaces or adds to the reward.

Enable it::

    plugins:
      judge:
        endpoint: http://127.0.0.1:8000/v1     # or model_path: a local checkpoint the embedded backend serves
        model: judge
        prompt: "...{task}...{transcript}... End with `SCORE: <0-10>`."
        scale: 0.1                              # score * scale
        weight: 1.0
        mode: replace                           # or add: reward + weight * score * scale

``post_process_batch`` (``AGL_ORDER = 1``, before the trace aggregator) asks
the judge about every succeeded rollout of the step, ``concurrency`` at once,
each request retried by the openai client: the prompt gets the task's input
(JSON, from the recipe's task files; its id when not found there) and the transcript — the rollout's last model call, prompt and
response, decoded by the policy's tokenizer, cut to its last
``transcript_chars`` characters. The verdict is the last match of
``verdict_pattern`` in the answer. Scores are cached per rollout id (a
rollout judged again, e.g. after a requeue, costs nothing).

A judge that fails (after its retries) or answers without a verdict never
gives a silent 0: the rollout is marked ``failed`` with the reason in its
``error``, so it is not trained on, and counted in ``judge/n_failed`` /
``judge/n_garbage``. Metrics: ``judge/n_scored``, ``judge/score_mean``,
``judge/cache_hits``, ``judge/prompt_tokens`` and ``judge/completion_tokens``
(the cost), ``timing_s/judge``.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from agl_core import HOOK_API_VERSION, hookimpl

from agl_plugin_teachers.settings import JudgeConfig

AGL_HOOK_API = HOOK_API_VERSION
AGL_ORDER = 1  # before the trace aggregator (5): the rewards it puts on the rows are the judged ones
NAME = "judge"


@dataclass
class Verdict:
    """A judge's answer about one rollout: its score, or why there is none (``failure``: "error"/"garbage")."""

    score: float | None
    failure: str | None = None
    reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0


def parse_verdict(answer: str, pattern: re.Pattern) -> float | None:
    """The number of the last match of ``pattern`` (its first group) in ``answer``, or None."""
    found = None
    for found in pattern.finditer(answer or ""):
        pass
    if found is None:
        return None
    try:
        return float(found.group(1))
    except (IndexError, TypeError, ValueError):
        return None


def transcript_text(rollout, tokenizer: Any, limit: int) -> str:
    """The rollout's last model call, prompt and response, decoded; its last ``limit`` characters."""
    calls = sorted((s for s in rollout.spans if s.kind == "llm_call"), key=lambda s: s.sequence_id)
    if calls:
        last = calls[-1]
        text = tokenizer.decode(list(last.prompt_token_ids) + list(last.response_token_ids))
    else:
        text = "\n".join(tokenizer.decode(list(t.prompt_ids) + list(t.response_ids)) for t in rollout.triplets[-1:])
    return text[-limit:]


@dataclass
class Judge:
    """Asks the judge (a :class:`~agl_plugin_teachers.endpoints.Served`) and keeps its verdicts by rollout id."""

    served: Any
    config: JudgeConfig
    tokenizer: Any
    cache: dict[str, Verdict] = field(default_factory=dict)
    task_inputs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        self.pattern = re.compile(self.config.verdict_pattern)
        self.pool = ThreadPoolExecutor(self.config.concurrency, thread_name_prefix="agl-judge")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.served.close()

    def judge(self, rollouts: list, task_inputs: dict[str, Any]) -> tuple[list, dict[str, float]]:
        """The rollouts with judged rewards (or marked failed) and the step's ``judge/…`` metrics."""
        start = time.perf_counter()
        todo = [r for r in rollouts if r.status == "succeeded" and r.rollout_id not in self.cache]
        hits = sum(r.status == "succeeded" and r.rollout_id in self.cache for r in rollouts)
        asked = self.pool.map(lambda r: self._ask(r, task_inputs.get(r.task_id, {"id": r.task_id})), todo)
        for rollout, verdict in zip(todo, asked):
            self.cache[rollout.rollout_id] = verdict
        asked_ids = {r.rollout_id for r in todo}
        out, scores, metrics = [], [], {"judge/n_failed": 0.0, "judge/n_garbage": 0.0, "judge/prompt_tokens": 0.0,
                                        "judge/completion_tokens": 0.0}
        for rollout in rollouts:
            if rollout.status != "succeeded":
                out.append(rollout)
                continue
            verdict = self.cache[rollout.rollout_id]
            if rollout.rollout_id in asked_ids:
                metrics["judge/prompt_tokens"] += verdict.prompt_tokens
                metrics["judge/completion_tokens"] += verdict.completion_tokens
            if verdict.score is None:
                metrics[f"judge/n_{verdict.failure}"] += 1
                out.append(rollout.model_copy(update={"status": "failed", "error": f"judge: {verdict.reason}"}))
                continue
            judged = self.config.weight * verdict.score * self.config.scale
            reward = judged if self.config.mode == "replace" else (rollout.final_reward or 0.0) + judged
            scores.append(verdict.score * self.config.scale)
            out.append(rollout.model_copy(update={"final_reward": reward}))
        metrics.update({"judge/n_scored": float(len(scores)), "judge/cache_hits": float(hits),
                        "timing_s/judge": time.perf_counter() - start})
        if scores:
            metrics["judge/score_mean"] = sum(scores) / len(scores)
        return out, metrics

    def _ask(self, rollout, task_input: Any) -> Verdict:
        cfg, name = self.config, self.served.name()
        prompt = cfg.prompt.format(task=json.dumps(task_input), transcript=transcript_text(
            rollout, self.tokenizer, cfg.transcript_chars))
        try:
            reply = self.served.client.chat.completions.create(
                model=cfg.model, messages=[{"role": "user", "content": prompt}], max_tokens=cfg.max_tokens,
                temperature=cfg.temperature)
        except Exception as exc:  # noqa: BLE001 - the rollout is marked with it
            return Verdict(None, "failed", f"the {name} failed (after {cfg.max_retries} retries): {exc}")
        usage = reply.usage
        tokens = dict(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens) if usage else {}
        answer = reply.choices[0].message.content if reply.choices else None
        score = parse_verdict(answer or "", self.pattern)
        if score is None:
            return Verdict(None, "garbage", f"the {name} answered no verdict matching {cfg.verdict_pattern!r}: "
                                            f"{(answer or '')[-200:]!r}", **tokens)
        return Verdict(score, **tokens)


@hookimpl
def plugin_config_schema():
    return JudgeConfig


@hookimpl(trylast=True)  # after the backend's: the policy's tokenizer exists then
def on_train_start(ctx):
    from agl_core.plugins import PluginError

    from agl_plugin_teachers.endpoints import Served, load_tokenizer, student_tokenizer

    cfg: JudgeConfig = ctx.plugin_config(NAME)
    tokenizer = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else student_tokenizer(ctx)
    if tokenizer is None:
        raise PluginError("plugins.judge decodes the rollouts' token ids with a tokenizer: set "
                          "plugins.judge.tokenizer (the policy's is used with agl-plugin-torch)")
    judge = Judge(Served(cfg, "judge"), cfg, tokenizer)
    judge.task_inputs = task_inputs(ctx.config.data)
    ctx.state[NAME] = judge


def task_inputs(data) -> dict[str, Any]:
    """The inputs of the recipe's train and val tasks by id: what ``{task}`` shows the judge."""
    from agl_core.rollout.tasks import load_tasks

    return {task.id: task.input for files, split in ((data.train_files, "train"), (data.val_files, "val"))
            for task in load_tasks(files, split)}


@hookimpl
def post_process_batch(ctx, batch):
    rollouts = batch.meta.get("rollouts")
    if not rollouts or "input_ids" in batch:
        return batch
    judge: Judge = ctx.state[NAME]
    judged, metrics = judge.judge(rollouts, judge.task_inputs)
    ctx.step_metrics.update(metrics)
    batch.meta["rollouts"] = judged
    return batch


@hookimpl
def on_train_end(ctx):
    judge = ctx.state.pop(NAME, None)
    if judge is not None:
        judge.close()
