"""Built-in plugin ``samples``: what the model wrote, as trained: a few rows of each step in ``<run_dir>/samples/``.

Off unless a recipe asks for it (``plugins: {samples: {rows: 8}}``, or ``-p samples``). Each step it writes
``samples/<step>.jsonl``: ``rows`` of the step's trained rows, drawn at random (seeded by the run's seed and the
step), one JSON object a line with the step, rollout id, group (``uid``), turn index, reward (the row's scores
summed), a summary of its advantages over its trained tokens, its lengths and its decoded prompt and response.
The text comes from the tokenizer the backend puts in ``ctx.tokenizer`` (the embedded backend does); without
one the record holds the token ids instead (``prompt_ids``, ``response_ids``) and ``"text": false``. The
response is every token after the prompt, the environment's tokens between the model's turns included (a
trajectory row); ``trained_tokens`` counts the model's own (``response_mask``).

It wraps the ``update_actor`` slot (``@hookimpl(wrapper=True)``), so the rows are exactly those the actor is
updated on: after the advantages, the drops, the floor to mini-batches and the balancing. Each step is written
once: a resumed run removes the files of the steps it logs again (``ctx.purge_step``). ``agl show RUN_DIR``
prints them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from agl_core import HOOK_API_VERSION, hookimpl

AGL_HOOK_API = HOOK_API_VERSION
AGL_OPT_IN = True  # an addition a recipe asks for, not a default
NAME = "samples"
DIRNAME = "samples"


class SamplesConfig(BaseModel):
    """The recipe section ``plugins.samples``."""

    model_config = ConfigDict(extra="forbid")
    rows: int = Field(8, ge=1, description="trained rows written per step (a random sample; all when fewer)")
    every: int = Field(1, ge=1, description="write every this many steps")


@hookimpl
def plugin_config_schema():
    return SamplesConfig


@hookimpl
def on_train_start(ctx):
    folder = ctx.run_dir / DIRNAME
    if folder.is_dir():
        for step, path in steps_in(folder).items():
            if step >= ctx.purge_step:
                path.unlink()


@hookimpl(wrapper=True)
def update_actor(ctx, batch):
    cfg = ctx.plugin_config(NAME)
    if ctx.step % cfg.every == 0 and len(batch):
        write_step(ctx.run_dir / DIRNAME, ctx.step, records(ctx, batch, cfg.rows))
    return (yield)


def records(ctx, batch, rows: int) -> list[dict[str, Any]]:
    """Up to ``rows`` of ``batch``'s rows as records (drawn with the run's seed and the step)."""
    import numpy as np

    rng = np.random.default_rng((ctx.config.trainer.seed, ctx.step))
    chosen = sorted(rng.choice(len(batch), size=min(rows, len(batch)), replace=False).tolist())
    width = batch["prompts"].shape[1]
    attention = batch["attention_mask"].bool()
    mask = batch["response_mask"].bool()
    tokenizer = getattr(ctx, "tokenizer", None)
    out = []
    for i in chosen:
        prompt = batch["prompts"][i][attention[i, :width]].tolist()
        response = batch["responses"][i][attention[i, width:]].tolist()
        advantages = batch["advantages"][i][mask[i]] if "advantages" in batch else None
        record: dict[str, Any] = {
            "step": ctx.step, "rollout_id": str(batch["rollout_id"][i]), "uid": str(batch["uid"][i]),
            "turn_index": int(batch["turn_index"][i]),
            "reward": float(batch["token_level_scores"][i].sum()),
            "advantage": None if advantages is None or not len(advantages) else {
                "mean": float(advantages.mean()), "min": float(advantages.min()), "max": float(advantages.max())},
            "prompt_length": len(prompt), "response_length": len(response), "trained_tokens": int(mask[i].sum()),
        }
        if tokenizer is not None:
            record.update(text=True, prompt=tokenizer.decode(prompt), response=tokenizer.decode(response))
        else:
            record.update(text=False, prompt_ids=prompt, response_ids=response)
        out.append(record)
    return out


def write_step(folder: Path, step: int, rows: list[dict[str, Any]]) -> Path:
    """Write one step's records to ``folder/<step>.jsonl``, whole or not at all."""
    folder.mkdir(exist_ok=True)
    path = folder / f"{step}.jsonl"
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    os.replace(partial, path)
    return path


def steps_in(folder: Path) -> dict[int, Path]:
    """The steps written in ``folder``, each with its file, in step order."""
    found = {int(p.stem): p for p in folder.glob("*.jsonl") if p.stem.isdigit()}
    return dict(sorted(found.items()))


def read_step(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
