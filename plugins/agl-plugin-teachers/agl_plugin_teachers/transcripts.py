"""Plugin ``transcripts``: offline training on a dataset of transcripts, no agent — ``collect_rollouts`` reads them.

The tasks of ``data.train_files`` are the transcripts, in one of two kinds:

* **Chat messages** — a task whose ``input`` holds ``messages`` (OpenAI chat
  format, ``tool_calls`` and ``tool`` messages included) and optionally
  ``tools`` and ``reward`` (default ``plugins.transcripts.reward``). Every
  assistant message becomes a model call: its prompt is the messages before
  it rendered by the tokenizer's chat template with the generation prompt,
  its response the tokens the template adds for the message. *These token
  ids are made by rendering text* — the one place agl_core trains on tokens
  a model did not sample; the template must render each assistant message as
  an extension of its prompt (a template that does not is an error naming the
  task and message).
* **An earlier run's games** — with ``plugins.transcripts.store`` (that run's
  SQLite store file), a task's rollouts in the store (succeeded, reward at
  least ``min_reward``), up to ``rollout.n`` of them, with the exact token ids
  their model sampled. The tasks are the earlier run's task file.

Pair it with ``algorithm.policy_loss.name: sft`` (plugin ``sft``) for
supervised fine-tuning; backends, checkpoints and loggers are the recipe's.
Validation (``mode="val"``) is not served from transcripts: use ``agl eval``,
or leave ``trainer.test_freq`` at 0.
"""

from __future__ import annotations

import json
from typing import Any

from agl_core import HOOK_API_VERSION, hookimpl
from agl_core.plugins import PluginError

from agl_plugin_teachers.settings import TranscriptsConfig

AGL_HOOK_API = HOOK_API_VERSION
NAME = "transcripts"


def render_calls(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 where: str) -> list[tuple[list[int], list[int]]]:
    """``(prompt ids, response ids)`` of each assistant message, rendered by ``tokenizer``'s chat template."""
    messages = [_template_message(m, f"{where}.messages[{i}]") for i, m in enumerate(messages)]
    calls = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _render(tokenizer, messages[:i], tools, True)
        full = _render(tokenizer, messages[:i + 1], tools, False)
        if full[:len(prompt)] != prompt or len(full) == len(prompt):
            raise ValueError(f"{where}: the chat template does not render messages[{i}] (assistant) as an extension "
                             f"of the prompt before it; these messages cannot become training rows")
        calls.append((prompt, full[len(prompt):]))
    if not calls:
        raise ValueError(f"{where}: no assistant message to train on")
    return calls


def _template_message(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError(f"{where} must be a message object with a 'role'")
    out = {**message, "content": message.get("content") or ""}
    if message.get("tool_calls"):
        # The OpenAI format holds arguments as a JSON string; chat templates iterate them as a mapping.
        out["tool_calls"] = [{**call, "function": {**call["function"], "arguments": _arguments(call, where)}}
                             for call in message["tool_calls"]]
    return out


def _arguments(call: dict[str, Any], where: str) -> dict[str, Any]:
    arguments = call.get("function", {}).get("arguments", {})
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        raise ValueError(f"{where}: a tool call's arguments are not JSON: {arguments!r:.80}") from None


def _render(tokenizer: Any, messages: list[dict[str, Any]], tools, generation_prompt: bool) -> list[int]:
    if not messages:
        return []
    return list(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                              tokenize=True, return_dict=False))


class Source:
    """The tokenizer that renders messages and the earlier run's store, opened once for the run."""

    def __init__(self, ctx, cfg: TranscriptsConfig):
        from agl_plugin_teachers.endpoints import load_tokenizer, student_tokenizer

        self.cfg = cfg
        self.tokenizer = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else student_tokenizer(ctx)
        self.by_task: dict[str, list] = {}
        if cfg.store is not None:
            self.by_task = stored_games(cfg.store, cfg.min_reward)

    def rollouts(self, task, step: int, n: int) -> list:
        from agl_core.data import Rollout, Triplet

        if "messages" in task.input:
            if self.tokenizer is None:
                raise PluginError("plugins.transcripts renders chat messages with a tokenizer: set "
                                  "plugins.transcripts.tokenizer (the policy's is used with agl-plugin-torch)")
            rollout_id = f"transcript-{step}-{task.id}"
            calls = render_calls(self.tokenizer, task.input["messages"], task.input.get("tools"), f"task {task.id}")
            triplets = [Triplet(prompt_ids=p, response_ids=r, rollout_id=rollout_id, turn_index=i)
                        for i, (p, r) in enumerate(calls)]
            reward = task.input.get("reward", self.cfg.reward)
            return [Rollout(rollout_id=rollout_id, task_id=task.id, status="succeeded", final_reward=reward,
                            triplets=triplets)]
        games = self.by_task.get(task.id, [])[-n:]
        return [game.model_copy(update={"rollout_id": f"transcript-{step}-{game.rollout_id}", "spans": [
            span.model_copy(update={"rollout_id": f"transcript-{step}-{game.rollout_id}"}) for span in game.spans]})
            for game in games]


def stored_games(path: str, min_reward: float | None) -> dict[str, list]:
    """The succeeded rollouts of an SQLite store file, with their spans, by task id (oldest first), reward at least
    ``min_reward``; those the earlier run consumed included (the store keeps them as the run's record)."""
    import sqlite3

    from agl_plugin_sqlite.store import SqliteStore

    # The store's query() lists only unconsumed rollouts: the ids of all are read from its table directly.
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        ids = [row[0] for row in conn.execute("SELECT rollout_id FROM rollouts WHERE status = 'succeeded'")]
    store = SqliteStore(path)
    try:
        games: dict[str, list] = {}
        for rollout in store.get_rollouts(ids):
            if rollout.final_reward is None or (min_reward is not None and rollout.final_reward < min_reward):
                continue
            games.setdefault(rollout.task_id, []).append(rollout)
    finally:
        store.close()
    for rollouts in games.values():
        rollouts.sort(key=lambda r: r.end_time or 0)
    return games


@hookimpl
def plugin_config_schema():
    return TranscriptsConfig


@hookimpl
def collect_rollouts(ctx, tasks, mode):
    if mode != "train":
        raise PluginError("plugins.transcripts serves training steps only: set trainer.test_freq=0 and "
                          "trainer.val_before_train=false, and measure the model with `agl eval`")
    if NAME not in ctx.state:
        ctx.state[NAME] = Source(ctx, ctx.plugin_config(NAME))
    source = ctx.state[NAME]
    rollouts = [r for task in tasks for r in source.rollouts(task, ctx.step, ctx.config.rollout.n)]
    ctx.step_metrics["transcripts/rollouts"] = float(len(rollouts))
    return rollouts
