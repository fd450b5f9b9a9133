"""The plugin as the core loads and runs it: entry point, settings, registrations, and a run of the real loop."""

import json
import random
from pathlib import Path

import pytest

import agl_plugin_traces.plugin as traces_plugin
from agl_core import HOOK_API_VERSION, hookimpl
from agl_core.components import Components
from agl_core.config import ConfigError
from agl_core.context import TrainContext
from agl_core.data import Batch, Rollout, Task
from agl_core.loop import Trainer
from agl_core.plugins import PluginError, PluginSet
from agl_core.testing import BatchRecorder, check_plugin
from traces_testkit import conversation, llm, rollout


def test_the_installed_entry_point_loads_and_passes_the_contract_checks():
    plugin = PluginSet.load(enable=["traces"]).plugins["traces"]
    assert (plugin.distribution, plugin.status) == ("agl-plugin-traces", "active")
    assert plugin.hooks == ["on_train_start", "plugin_config_schema", "post_process_batch",
                            "register_aggregators", "register_estimators"]
    assert plugin.order == 5
    check_plugin(traces_plugin, "traces")


def test_it_registers_both_aggregators_and_the_rollout_level_estimators():
    components = Components.collect(PluginSet.load(enable=["traces"]))
    assert {"transition", "trajectory"} <= set(components.names("aggregator"))
    assert {"grpo_rollout", "grpo_passk_rollout", "rloo_rollout",
            "reinforce_plus_plus_baseline_rollout"} <= set(components.names("estimator"))


def test_settings_are_validated_with_the_key_path(make_recipe):
    recipe, _ = make_recipe(["plugins.traces.aggregator=trajectory", "plugins.traces.max_rows_per_rollout=3"])
    cfg = recipe.plugin_config["traces"]
    assert (cfg.aggregator, cfg.max_rows_per_rollout, cfg.later_prompt_overflow) == ("trajectory", 3, "response")
    with pytest.raises(ConfigError, match="plugins.traces.trajectory_max_length: unknown key"):
        make_recipe(["plugins.traces.trajectory_max_length=3"])
    with pytest.raises(ConfigError, match="plugins.traces.later_prompt_overflow"):
        make_recipe(["plugins.traces.later_prompt_overflow=train"])


def context(make_recipe, overrides):
    """The run context a recipe gives, as the trainer builds it."""
    recipe, pset = make_recipe(overrides)
    return TrainContext(recipe, pset, Components.collect(pset), Path(recipe.trainer.run_dir))


def test_an_unknown_aggregator_name_lists_the_registered_ones_at_start_up(make_recipe):
    ctx = context(make_recipe, ["plugins.traces.aggregator=sft"])
    with pytest.raises(PluginError, match="unknown aggregator 'sft'; registered: .*trajectory"):
        traces_plugin.on_train_start(ctx)
    with pytest.raises(PluginError, match="unknown aggregator 'sft'"):
        traces_plugin.post_process_batch(ctx, Batch(meta={"rollouts": [rollout([llm(0, [1], [2])])]}))


def test_the_tokenizer_setting_loads_a_hugging_face_tokenizer_to_classify_breaks(make_recipe, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"<s>": 0, "</s>": 1, "hello": 2, "world": 3, "again": 4, "[UNK]": 5}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<s>", eos_token="</s>",
                                         unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    ctx = context(make_recipe, ["plugins.traces.aggregator=trajectory", f"plugins.traces.tokenizer={tmp_path / 'tok'}",
                                "plugins.traces.mismatch_log_dir=mismatches"])
    ctx.step = 3
    spans = [llm(0, [0, 2], [3, 1]), llm(1, [0, 2, 3, 0, 4], [1])]  # </s> re-rendered as <s>: a template break
    batch = traces_plugin.post_process_batch(ctx, Batch(meta={"rollouts": [rollout(spans)]}))
    assert len(batch) == 2 and ctx.step_metrics["training/mismatch/template"] == 1
    (record,) = [json.loads(line) for line in (ctx.run_dir / "mismatches" / "mismatches.jsonl").open()]
    assert (record["class"], record["turn_index"], record["step"]) == ("template", 1, 3)


# ----------------------------------------------------------------------------- the real loop


class Agents:
    """Fills collect_rollouts: agents that call the model 1-4 times, each prompt extending the last.

    Token ids stay below 8, the instant backend's vocabulary. One rollout in
    five re-renders its history (a prefix break); the reward is random but
    equal within task "same" (a zero-variance group).
    """

    AGL_HOOK_API = HOOK_API_VERSION

    def __init__(self):
        self.rng = random.Random(0)

    @hookimpl
    def collect_rollouts(self, ctx, tasks, mode):
        out = []
        for task in tasks:
            for sample in range(ctx.config.rollout.n if mode == "train" else 1):
                rid = f"{mode}-{ctx.step}-{task.id}-{sample}"
                turns = [([self.rng.randrange(8)], [self.rng.randrange(8) for _ in range(self.rng.randint(1, 3))])
                         for _ in range(self.rng.randint(1, 4))]
                spans = conversation([1, 2], turns, rollout_id=rid)
                if self.rng.random() < 0.2:
                    spans.append(llm(len(spans), [7, 7], [self.rng.randrange(8)], rollout_id=rid))
                value = 0.5 if task.id == "same" else self.rng.random()
                out.append(Rollout(rollout_id=rid, task_id=task.id, sample_index=sample, status="succeeded",
                                   final_reward=value, spans=spans))
        return out


def test_two_steps_of_the_core_loop_with_the_instant_backend(make_recipe):
    recorder = BatchRecorder()
    recipe, pset = make_recipe(
        ["plugins.traces.aggregator=trajectory", "plugins.traces.drop_zero_variance_groups=true",
         "plugins.traces.max_rows_per_rollout=1", "plugins.traces.trajectory_max_response_length=12",
         "plugins.slots.collect_rollouts=agents", "algorithm.estimator=grpo_rollout",
         "data.train_batch_size=4", "data.max_prompt_length=6", "data.max_response_length=6", "rollout.n=4",
         "algorithm.ppo_mini_batch_size=2", "trainer.total_steps=2", "trainer.val_before_train=false"],
        plugins=[("agents", Agents()), ("recorder", recorder)], flags=["instant"])
    tasks = [Task(id="same", input={})] + [Task(id=f"t{i}", input={}) for i in range(3)]
    trainer = Trainer(recipe, pset, train_tasks=tasks, val_tasks=[])
    assert [name for name, _ in trainer.plan.post_process] == ["traces", "instant", "recorder"]
    metrics = trainer.fit()

    assert metrics["training/global_step"] == 2 and "actor/pg_loss" in metrics
    assert metrics["training/n_groups_zero_variance"] >= 1  # the task "same"
    assert {"training/n_triplets_over_rollout_cap", "training/n_unmerged_rollouts", "training/mismatch/unclassified",
            "training/n_triplets_response_truncated"} <= set(metrics)
    for batch in recorder.batches:
        assert "same" not in set(batch["uid"])
        assert len(set(batch["rollout_id"])) == len(batch)  # at most one row per rollout
        assert batch["responses"].shape[1] == 12 and batch["prompts"].shape[1] == 6
        assert (batch["response_mask"] == 0).logical_and(batch["attention_mask"][:, 6:] == 1).any()  # observations
    state = trainer.ctx.state["instant"]
    assert state.calls.count("update_actor") == 2
    logged = [json.loads(line) for line in (trainer.ctx.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == [1, 2] and "training/n_calls" in logged[0]
