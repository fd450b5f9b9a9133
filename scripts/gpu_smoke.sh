#!/usr/bin/env bash
# Three training steps of examples/calc_verl on one GPU through agl-plugin-verl (verl's FSDP workers and
# vLLM rollout servers), then the per-stage timings of each step.
#
# STATUS: written and reviewed, NOT RUN by its authors (the asynchronous part at the end neither): the machines this project is developed on have no
# GPU (the CPU half of the path, verl's real worker groups on a CPU engine, runs in the test suite).
#
# What it needs (a fresh environment on a Linux machine with one NVIDIA GPU of >= 40 GB, a driver for
# CUDA 12.8 or newer, Python 3.11 or 3.12, and the Hugging Face Hub reachable unless MODEL is a local path):
#
#   python -m venv .venv-gpu && . .venv-gpu/bin/activate
#   pip install 'verl[vllm]==0.9.1'      # verl's GPU stack: torch 2.11.0 (CUDA), vLLM 0.24.0, transformers 5.9.0, Ray
#   pip install -e . -e plugins/agl-plugin-traces -e plugins/agl-plugin-verl -e plugins/agl-plugin-lora  # lora: recipe_lora.yaml
#
# Do not install with -c constraints.txt here: it pins the CPU build of torch. flash-attn is not needed: the
# recipe uses PyTorch's attention (sdpa) for training; vLLM brings its own kernels.
#
# Usage:  scripts/gpu_smoke.sh                       # Qwen/Qwen2.5-0.5B-Instruct from the Hub
#         MODEL=/models/qwen2.5-0.5b-instruct scripts/gpu_smoke.sh
# Extra arguments are recipe overrides, e.g.  scripts/gpu_smoke.sh rollout.n=8
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
RUN_DIR=${RUN_DIR:-runs/gpu_smoke}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python - <<'PY'
import importlib.metadata as md
import torch
assert torch.cuda.is_available(), "torch does not see a CUDA GPU (a CPU build of torch is installed?)"
for dist in ("torch", "verl", "vllm", "ray", "transformers", "agl-core", "agl-plugin-verl", "agl-plugin-traces"):
    print(f"{dist:18} {md.version(dist)}")
from agl_plugin_verl.compat import verl_version
verl_version()  # refuses an unsupported verl before anything starts
PY

rm -rf "$RUN_DIR"
# 8 problems x 4 episodes = 32 trajectory rows a step, two PPO mini-batches; a checkpoint at step 3
# exercises verl's checkpoint manager; no validation (it would time a second rollout).
agl train examples/calc_verl/recipe.yaml \
    trainer.run_dir="$RUN_DIR" trainer.total_steps=3 trainer.save_freq=3 trainer.test_freq=0 \
    trainer.val_before_train=false trainer.resume=never \
    data.train_batch_size=8 rollout.n=4 algorithm.ppo_mini_batch_size=16 rollout.n_workers=32 \
    plugins.verl.actor_rollout_ref.model.path="$MODEL" "$@"

python - "$RUN_DIR/metrics.jsonl" <<'PY'
import json, sys
stages = ["gen", "gen_postprocess", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor", "step"]
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
rows = [row for row in rows if row["step"] > 0]
print("\nper-stage seconds (timing_s/*), rewards and throughput, by step")
print(f"{'step':>4} " + " ".join(f"{s:>15}" for s in stages) + f" {'reward':>7} {'tokens/s/gpu':>12}")
for row in rows:
    cells = " ".join(f"{row.get(f'timing_s/{s}', float('nan')):>15.2f}" for s in stages)
    reward = row.get("critic/score/mean_before_processing", float("nan"))  # mean episode reward of the step
    print(f"{row['step']:>4} {cells} {reward:>7.3f} {row.get('perf/throughput', float('nan')):>12.1f}")
assert len(rows) == 3, f"expected 3 logged steps, found {len(rows)}"
PY
ls "$RUN_DIR"/checkpoints/global_step_3/verl/actor

# ------------------------------------------------------------------ asynchronous training (issue 14)
# 1. The verl plugin refuses trainer.async.max_staleness >= 1 at start-up, naming what it lacks (verl's hybrid
#    engine shares the GPUs between actor and vLLM; verl 0.9's async trainers need separate pools), and
#    nothing starts on the GPU.
ASYNC_DIR=${RUN_DIR}_async
rm -rf "$ASYNC_DIR" "${ASYNC_DIR}_verl"
if agl train examples/calc_verl/recipe.yaml trainer.run_dir="${ASYNC_DIR}_verl" trainer.total_steps=1 \
        trainer.resume=never trainer.async.max_staleness=1 \
        plugins.verl.actor_rollout_ref.model.path="$MODEL" > "${ASYNC_DIR}_verl.log" 2>&1; then
    echo "the verl plugin trained with trainer.async.max_staleness=1: it should have refused" >&2; exit 1
fi
grep -q "cannot train asynchronously" "${ASYNC_DIR}_verl.log"
echo "verl plugin: asynchronous training refused at start-up, as documented"

# 2. The embedded backend (agl-plugin-torch, installed here) on the
#    GPU with k=1: the serving copy generates while the actor trains. Ten steps of the default recipe; the
#    check reads the async/ metrics: staleness within the bound, nothing dropped, weight syncs timed.
pip install -q -e plugins/agl-plugin-torch -e plugins/agl-plugin-sqlite
agl train examples/guess_number/recipe.yaml trainer.run_dir="$ASYNC_DIR" trainer.total_steps=10 \
    trainer.test_freq=5 trainer.save_freq=10 trainer.progress=false trainer.async.max_staleness=1 \
    plugins.torch.model.device=cuda plugins.torch.num_threads=null

python - "$ASYNC_DIR/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
steps = [row for row in rows if row["step"] > 0 and "async/staleness_max" in row]
print(f"\n{'step':>4} {'staleness_max':>13} {'dropped':>7} {'weight_sync_s':>13} {'backend_idle_s':>14} {'step_s':>7}")
for row in steps:
    print(f"{row['step']:>4} {row['async/staleness_max']:>13.0f} {row['async/n_stale_dropped']:>7.0f} "
          f"{row['async/weight_sync_s']:>13.3f} {row['async/backend_idle_s']:>14.2f} {row['timing_s/step']:>7.2f}")
assert len(steps) == 10, f"expected 10 asynchronous steps, found {len(steps)}"
assert all(row["async/staleness_max"] <= 1 and row["async/n_stale_dropped"] == 0 for row in steps)
PY
ls "$ASYNC_DIR"/checkpoints/global_step_10
