"""Plugin ``judge``: a judge scores each rollout, or each turn; the score replaces or adds to the reward.

Enable it::

    plugins:
      judge:
        endpoint: http://127.0.0.1:8000/v1     # or model_path: a local checkpoint the embedded backend serves
        model: judge
        prompt: "...{task}...{transcript}... End with `SCORE: <0-10>`."
        scale: 0.1                              # score * scale
        weight: 1.0
        mode: replace                           # or add: reward + weight * score * scale
        per: rollout                            # or turn: each model call gets its own judged reward
        kind: chat                              # or reward_model: a value-head model, local (model_path) or
                                                # behind an endpoint answering vLLM's POST /pooling

``post_process_batch`` (``AGL_ORDER = 1``, before the trace aggregator) asks
the judge about every succeeded rollout of the step (``per: rollout``) or
every trainable model call of it (``per: turn``). A ``chat`` judge gets
``concurrency`` requests at once, each retried by the openai client: the
prompt gets the task's input (JSON, from the recipe's task files; its id
when not found there) and the transcript — for a rollout its last model call,
prompt and response; for a turn the call's prompt and response (or the turn
alone, ``turn_transcript: turn``) — decoded by the policy's tokenizer, cut to
its last ``transcript_chars`` characters. The verdict is the last match of
``verdict_pattern`` in the answer. A ``reward_model``
(:mod:`agl_plugin_teachers.reward_model`) scores the transcripts' tokens in
batched forward passes. Verdicts are cached per rollout id and turn (a
rollout judged again, e.g. after a requeue, costs nothing).

Per turn, a judged call's reward is ``weight * score * scale`` (``replace``),
or that added to what the call's reward was (``add``: its own reward, or —
when no call of the rollout had one — the rollout's reward on its last judged
call, 0 on the others); it becomes a ``reward`` span on the call marked
``reward_source: judge`` in place of the call's reward spans, so the rows'
per-call columns hold it with source ``judge`` and the step-level estimators
(``gigpo``, ``turn_grpo``) take it as the call's own. The rollout's reward
becomes the sum of its judged calls' ``weight * score * scale``
(``replace``), or that sum added to it (``add``).

A judge that fails (after its retries) or answers without a verdict never
gives a silent 0: a rollout is marked ``failed`` with the reason in its
``error``, so it is not trained on; a turn gets the reason as its span's
``error``, so the call is not trained on (the aggregators count it in
``training/n_calls_error``) and the rollout's other turns are; a rollout
none of whose turns got a verdict is marked ``failed``. Metrics (per
transcript: a rollout or a turn): ``judge/n_scored``, ``judge/score_mean``,
``judge/n_failed``, ``judge/n_garbage``, ``judge/cache_hits``,
``judge/n_rollouts_failed``, ``judge/prompt_tokens`` and
``judge/completion_tokens`` (the cost), ``timing_s/judge``.
"""

from __future__ import annotations

import bisect
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from agl_core import HOOK_API_VERSION, hookimpl
from agl_core.data import REWARD_FROM_JUDGE, REWARD_SOURCE_KEY, Span

from agl_plugin_teachers.settings import JudgeConfig
from agl_plugin_teachers.verdicts import Transcript, Verdict, parse_verdict, rollout_transcript, turn_transcripts

AGL_HOOK_API = HOOK_API_VERSION
AGL_ORDER = 1  # before the trace aggregator (5): the rewards it puts on the rows are the judged ones
NAME = "judge"


class ChatJudge:
    """A chat model (a :class:`~agl_plugin_teachers.endpoints.Served`) asked about each transcript with the prompt;
    its verdict parsed from the answer."""

    def __init__(self, served: Any, config: JudgeConfig, tokenizer: Any):
        self.served, self.config, self.tokenizer = served, config, tokenizer
        self.pattern = re.compile(config.verdict_pattern)
        self.pool = ThreadPoolExecutor(config.concurrency, thread_name_prefix="agl-judge")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.served.close()

    def score(self, transcripts: list[Transcript], task_inputs: dict[str, Any]) -> list[Verdict]:
        """One verdict per transcript, ``concurrency`` requests at once."""
        return list(self.pool.map(lambda t: self._ask(t, task_inputs.get(t.task_id, {"id": t.task_id})),
                                  transcripts))

    def _ask(self, transcript: Transcript, task_input: Any) -> Verdict:
        cfg, name = self.config, self.served.name()
        text = self.tokenizer.decode(transcript.ids)[-cfg.transcript_chars:]
        prompt = cfg.prompt.format(task=json.dumps(task_input), transcript=text,
                                   turn="" if transcript.turn is None else transcript.turn)
        try:
            reply = self.served.client.chat.completions.create(
                model=cfg.model, messages=[{"role": "user", "content": prompt}], max_tokens=cfg.max_tokens,
                temperature=cfg.temperature)
        except Exception as exc:  # noqa: BLE001 - the rollout (or turn) is marked with it
            return Verdict(None, "failed", f"the {name} failed (after {cfg.max_retries} retries): {exc}")
        usage = reply.usage
        tokens = dict(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens) if usage else {}
        answer = reply.choices[0].message.content if reply.choices else None
        score = parse_verdict(answer or "", self.pattern)
        if score is None:
            return Verdict(None, "garbage", f"the {name} answered no verdict matching {cfg.verdict_pattern!r}: "
                                            f"{(answer or '')[-200:]!r}", **tokens)
        return Verdict(score, **tokens)


@dataclass
class Judge:
    """Asks a scorer (:class:`ChatJudge` or :class:`~agl_plugin_teachers.reward_model.RewardModel`) about rollouts
    or their turns, keeps its verdicts by (rollout id, turn) and puts them into the rewards."""

    scorer: Any
    config: JudgeConfig
    cache: dict[tuple[str, int | None], Verdict] = field(default_factory=dict)
    task_inputs: dict[str, Any] = field(default_factory=dict)

    def close(self) -> None:
        self.scorer.close()

    def judge(self, rollouts: list, task_inputs: dict[str, Any]) -> tuple[list, dict[str, float]]:
        """The rollouts with judged rewards (or marked failed) and the step's ``judge/…`` metrics."""
        from agl_plugin_traces.calls import TraceCounts, rollout_calls

        start = time.perf_counter()
        per_turn = self.config.per == "turn"
        calls, transcripts = {}, {}
        for rollout in rollouts:
            if rollout.status != "succeeded":
                continue
            if per_turn:
                calls[rollout.rollout_id] = rollout_calls(rollout, TraceCounts())
                transcripts[rollout.rollout_id] = turn_transcripts(rollout, calls[rollout.rollout_id],
                                                                   self.config.turn_transcript == "turn")
            else:
                transcripts[rollout.rollout_id] = [rollout_transcript(rollout)]
        every = [t for ts in transcripts.values() for t in ts]
        todo = [t for t in every if t.key not in self.cache]
        metrics = {"judge/n_failed": 0.0, "judge/n_garbage": 0.0, "judge/n_rollouts_failed": 0.0,
                   "judge/prompt_tokens": 0.0, "judge/completion_tokens": 0.0,
                   "judge/cache_hits": float(len(every) - len(todo))}
        for transcript, verdict in zip(todo, self.scorer.score(todo, task_inputs)):
            self.cache[transcript.key] = verdict
            metrics["judge/prompt_tokens"] += verdict.prompt_tokens
            metrics["judge/completion_tokens"] += verdict.completion_tokens
        scores, out = [], []
        for rollout in rollouts:
            if rollout.rollout_id not in transcripts:
                out.append(rollout)
                continue
            verdicts = {t.turn: self.cache[t.key] for t in transcripts[rollout.rollout_id]}
            for verdict in verdicts.values():
                if verdict.score is None:
                    metrics[f"judge/n_{verdict.failure}"] += 1
                else:
                    scores.append(verdict.score * self.config.scale)
            judged = self._turns(rollout, calls[rollout.rollout_id], verdicts) if per_turn else \
                self._rollout(rollout, verdicts[None])
            metrics["judge/n_rollouts_failed"] += judged.status == "failed"
            out.append(judged)
        metrics.update({"judge/n_scored": float(len(scores)), "timing_s/judge": time.perf_counter() - start})
        if scores:
            metrics["judge/score_mean"] = sum(scores) / len(scores)
        return out, metrics

    def _judged(self, verdict: Verdict) -> float:
        return self.config.weight * verdict.score * self.config.scale

    def _rollout(self, rollout, verdict: Verdict):
        if verdict.score is None:
            return rollout.model_copy(update={"status": "failed", "error": f"judge: {verdict.reason}"})
        judged = self._judged(verdict)
        reward = judged if self.config.mode == "replace" else (rollout.final_reward or 0.0) + judged
        return rollout.model_copy(update={"final_reward": reward})

    def _turns(self, rollout, calls: list, verdicts: dict[int, Verdict]):
        """The rollout with a judge's reward span on each judged call (in place of the call's reward spans), the
        reason as the ``error`` of each call the judge failed on, and the rollout's reward from the judged calls.
        A rollout of triplets (no ``llm_call`` spans): the judged reward on each judged triplet, marked the
        judge's, and the others left out."""
        scored = [c for c in calls if verdicts[c.turn].score is not None]
        if not scored:
            if not calls:
                return rollout
            reasons = "; ".join(f"turn {c.turn}: {verdicts[c.turn].reason}" for c in calls)
            return rollout.model_copy(update={"status": "failed", "error": f"judge: no turn judged ({reasons})"})
        add = self.config.mode == "add"
        has_own = any(c.reward is not None for c in calls)
        rewards = {}  # turn -> the call's reward now
        for call in scored:
            rewards[call.turn] = self._judged(verdicts[call.turn])
            if add:  # what the step-level estimators would have taken as the call's reward
                rewards[call.turn] += (call.reward or 0.0) if has_own else \
                    (rollout.final_reward or 0.0) if call is scored[-1] else 0.0
        total = sum(self._judged(verdicts[call.turn]) for call in scored)
        reward = (rollout.final_reward or 0.0) + total if add else total

        def marks(turn: int) -> dict[str, Any]:
            return {REWARD_SOURCE_KEY: REWARD_FROM_JUDGE, "judge_score": verdicts[turn].score}

        llm = sorted((s for s in rollout.spans if s.kind == "llm_call"), key=lambda s: s.sequence_id)
        if not llm:
            triplets = [t.model_copy(update={"reward": rewards[t.turn_index],
                                             "metadata": {**t.metadata, **marks(t.turn_index)}})
                        for t in rollout.triplets if t.turn_index in rewards]
            return rollout.model_copy(update={"triplets": triplets, "final_reward": reward})
        turn_of = {id(span): turn for turn, span in enumerate(llm)}
        sequence_ids = [s.sequence_id for s in llm]
        spans = []
        for span in rollout.spans:
            if span.kind == "reward" and bisect.bisect_right(sequence_ids, span.sequence_id) - 1 in rewards:
                continue  # the call's reward is the judged one now (which, with mode add, counts it)
            verdict = verdicts.get(turn_of.get(id(span), -1))
            if verdict is not None and verdict.score is None:
                span = span.model_copy(update={"attributes": {**span.attributes, "error": f"judge: {verdict.reason}"}})
            spans.append(span)
        for turn, value in rewards.items():
            call = llm[turn]
            spans.append(Span(rollout_id=call.rollout_id, attempt_id=call.attempt_id, sequence_id=call.sequence_id,
                              kind="reward", reward=value, attributes=marks(turn)))
        return rollout.model_copy(update={"spans": spans, "final_reward": reward})


def build_judge(config: JudgeConfig, tokenizer: Any) -> Judge:
    """The judge a section describes; ``tokenizer`` is the one of the rollouts' token ids (the policy's)."""
    if config.kind == "reward_model":
        from agl_plugin_teachers.reward_model import EndpointRewardModel, RewardModel

        return Judge((RewardModel if config.model_path is not None else EndpointRewardModel)(config, tokenizer),
                     config)
    from agl_plugin_teachers.endpoints import Served

    return Judge(ChatJudge(Served(config, "judge"), config, tokenizer), config)


@hookimpl
def plugin_config_schema():
    return JudgeConfig


@hookimpl(trylast=True)  # after the backend's: the policy's tokenizer exists then
def on_train_start(ctx):
    from agl_core.plugins import PluginError

    from agl_plugin_teachers.endpoints import load_tokenizer, student_tokenizer

    cfg: JudgeConfig = ctx.plugin_config(NAME)
    tokenizer = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else student_tokenizer(ctx)
    if tokenizer is None:
        raise PluginError("plugins.judge decodes the rollouts' token ids with a tokenizer: set "
                          "plugins.judge.tokenizer (the policy's is used with agl-plugin-torch)")
    judge = build_judge(cfg, tokenizer)
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
