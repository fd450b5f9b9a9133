"""Offline SFT: transcripts rendered by the chat template (from JSONL tasks) and an earlier run's games (from its
SQLite store) trained on with the sft loss, no agent."""

from __future__ import annotations

import json

import pytest

from agl_plugin_teachers.transcripts import render_calls

from runs import logged, recipe_file, train

TOOLS = [{"type": "function", "function": {"name": "guess", "parameters": {"properties": {"number": {}}}}}]


def chat(secret: int) -> dict:
    return {"messages": [
        {"role": "user", "content": "guess a number from 1 to 7"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "lower , from 1 to 3"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "guess", "arguments": json.dumps({"number": secret})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "higher"},
        {"role": "assistant", "content": str(secret)}], "tools": TOOLS}


def test_each_assistant_message_is_a_call_rendered_by_the_template(backend):
    tokenizer = backend.tokenizer
    transcript = chat(2)
    calls = render_calls(tokenizer, transcript["messages"], TOOLS, "task t")
    assert len(calls) == 3
    messages = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": {"number": 2}}}
                                     for c in m["tool_calls"]]} if m.get("tool_calls") else m
                for m in transcript["messages"]]
    for (prompt, response), upto in zip(calls, (1, 3, 5)):
        assert prompt == tokenizer.apply_chat_template(messages[:upto], tools=TOOLS, add_generation_prompt=True,
                                                       return_dict=False)
    assert tokenizer.decode(calls[0][1]) == "4 <|end|>"
    assert tokenizer.decode(calls[2][1]) == "2 <|end|>"
    with pytest.raises(ValueError, match="task t: no assistant message"):
        render_calls(tokenizer, transcript["messages"][:1], None, "task t")


def test_offline_sft_from_chat_transcripts_lowers_their_nll(tmp_path):
    data = tmp_path / "transcripts.jsonl"
    data.write_text("".join(json.dumps({"id": f"chat{s}", "input": chat(s)}) + "\n" for s in (2, 3)))
    path = recipe_file(tmp_path, data={"train_files": [str(data)], "train_batch_size": 2},
                       algorithm={"policy_loss": {"name": "sft"}, "ppo_mini_batch_size": 2, "ppo_epochs": 2},
                       rollout={"agent": None}, trainer={"total_steps": 4})
    from agl_core.config import load
    from agl_core.loop import Trainer

    recipe, pset = load(path, ["plugins.torch.actor.lr=0.02", "plugins.transcripts={}", "plugins.sft={}"],
                        ["torch", "traces", "sft", "transcripts"])
    trainer = Trainer(recipe, pset)
    trainer.fit()
    metrics = logged(trainer.ctx.run_dir)
    assert [metrics[s]["transcripts/rollouts"] for s in (1, 2, 3, 4)] == [2.0] * 4
    assert metrics[1]["sft/rows"] >= 2
    nll = [metrics[s]["actor/sft_nll"] for s in (1, 2, 3, 4)]
    assert nll[3] < nll[0] * 0.8, nll


def test_offline_sft_from_an_earlier_runs_store(tmp_path):
    """The games of a first run (its SQLite store) are the second run's transcripts, with their exact token ids."""
    first = recipe_file(tmp_path, "first.yaml", rollout={"store": "sqlite"},
                        trainer={"run_dir": str(tmp_path / "first"), "total_steps": 2})
    train(first, ["sqlite"])
    store = tmp_path / "first" / "rollouts.sqlite"
    path = recipe_file(tmp_path, algorithm={"policy_loss": {"name": "sft"}, "ppo_mini_batch_size": 1},
                       trainer={"total_steps": 1})
    trainer = train(path, ["sft", "transcripts"], [f"plugins.transcripts.store={store}", "plugins.sft={}"])
    metrics = logged(trainer.ctx.run_dir)
    # step 1 takes tasks t2 and t5 (the first batch); the first run played rollout.n=2 games of each per step,
    # 2 steps: up to rollout.n=2 of them (the latest) per task
    assert metrics[1]["transcripts/rollouts"] == 4.0
    assert metrics[1]["actor/sft_nll"] > 0
    with pytest.raises(Exception, match="is not a file"):
        train(path, ["sft", "transcripts"], [f"plugins.transcripts.store={tmp_path / 'nope.sqlite'}",
                                             "plugins.sft={}"])
