#!/usr/bin/env bash
# The verl backend (agl-plugin-verl: verl's FSDP workers and vLLM rollout servers) on one GPU, in phases that
# each end with scripts/check_run.py, which fails a run that did not train (a skipped step, failed or refused
# calls, served log-probs that are not the trainer's, non-finite losses, no checkpoint, a resume that started
# over). The model is a tiny one made by scripts/make_smoke_model.py: no Hub, no download.
#
#   A. three steps of examples/smoke/recipe_verl.yaml with validation and a checkpoint at step 3;
#   B. one more step resumed from that checkpoint (check_run --resumed-at 3);
#   C. three steps with LoRA (plugin lora, rank 8): the served log-probs must be the adapted policy's;
#   D. a trace of the GPU's memory during A (nvidia-smi every 200 ms): the rollout servers' sleep must free
#      most of what they hold while the actor trains.
#
# STATUS: the CPU dry run (AGL_SMOKE_DEVICE=cpu: the same phases A-C and the same checker on the embedded
# backend, D skipped) runs in the test suite; on a GPU with verl it has not been run by its authors: the one
# GPU machine this project has been lent has no verl, vLLM or Ray (scripts/gpu_smoke_embedded.sh runs there).
#
# What it needs on the GPU machine: Python 3.11/3.12, one NVIDIA GPU (>= 24 GB), a driver for CUDA 12.8+, and
#   pip install 'verl[vllm]==0.9.1' peft    # verl's GPU stack: torch (CUDA), vLLM, transformers, Ray
# with this checkout's packages importable: installed (pip install --no-deps -e . -e plugins/agl-plugin-verl
# -e plugins/agl-plugin-traces -e plugins/agl-plugin-lora) or, without, from source: the script then writes
# their metadata itself (scripts/source_dists.py; nothing is built or downloaded). Do not install with
# -c constraints.txt (it pins the CPU build of torch).
#
# Usage:  scripts/gpu_smoke.sh                 # everything under $OUT (default runs/gpu_smoke_out)
#         MODEL=/models/some-local-hf-dir scripts/gpu_smoke.sh    # another local model instead of the tiny one
# Exit 0: every phase passed; 1: a phase failed; 2: unusable (no GPU, verl or vLLM missing).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
DEVICE=${AGL_SMOKE_DEVICE:-cuda}
OUT=${OUT:-$REPO/runs/gpu_smoke_out}
WORK=${AGL_SMOKE_WORK:-$(mktemp -d /tmp/agl_gpu_smoke.XXXXXX)}
PY=${PYTHON:-python3}
START=$SECONDS
mkdir -p "$OUT" "$WORK"
FAILED=()
unusable() { echo "UNUSABLE: $*"; exit 2; }
phase() { echo; echo "=== $* [$((SECONDS - START)) s]"; }

phase "0. environment ($DEVICE)"
if ! $PY -c 'import importlib.metadata as m; m.version("agl-core")' 2>/dev/null; then
    SOURCES=$($PY scripts/source_dists.py "$WORK/site" "$REPO" "$REPO"/plugins/agl-plugin-{verl,torch,traces,lora}) \
        || unusable "scripts/source_dists.py failed"
    export PYTHONPATH="$SOURCES:$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ "$DEVICE" = cuda ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || unusable "no nvidia-smi"
    $PY - <<'PY' || unusable "torch sees no GPU, or verl/vLLM is missing or unsupported"
import importlib.metadata as md
import torch
assert torch.cuda.is_available(), "torch does not see a CUDA GPU (a CPU build of torch is installed?)"
for dist in ("torch", "verl", "vllm", "ray", "transformers", "peft", "agl-core", "agl-plugin-verl"):
    print(f"{dist:16} {md.version(dist)}")
from agl_plugin_verl.compat import verl_version
verl_version()  # refuses an unsupported verl before anything starts
PY
else
    $PY -c 'import agl_plugin_torch, agl_plugin_lora' || unusable "the embedded backend or the lora plugin is missing"
fi

MODEL=${MODEL:-}
if [ -z "$MODEL" ]; then
    MODEL=$WORK/model
    $PY scripts/make_smoke_model.py "$MODEL" > /dev/null || unusable "could not make the smoke model"
fi
if [ "$DEVICE" = cuda ]; then
    RECIPE=examples/smoke/recipe_verl.yaml
    BACKEND=(plugins.verl.actor_rollout_ref.model.path="$MODEL")
else  # the dry run: the same recipe and checks on the embedded backend, the same model from its directory
    RECIPE=examples/smoke/recipe.yaml
    BACKEND=(plugins.torch.model.path="$MODEL" plugins.torch.model.build=null)
fi
train() { $PY -m agl_core.cli train "$RECIPE" "${BACKEND[@]}" "$@"; }
check() {
    local name=$1; shift
    if $PY scripts/check_run.py "$@" --initial-model "$MODEL" > "$OUT/check_$name.txt"; then
        echo "check $name: PASS"
    else
        echo "check $name: FAIL"; grep "^FAIL" "$OUT/check_$name.txt"; FAILED+=("$name")
    fi
}

RUN=$WORK/run
phase "A. three steps, validation, checkpoint"
TRACE_PID=
if [ "$DEVICE" = cuda ]; then
    nvidia-smi --query-gpu=timestamp,memory.used,memory.total --format=csv,noheader,nounits -lms 200 \
        > "$OUT/gpu_memory.csv" &
    TRACE_PID=$!
fi
train trainer.run_dir="$RUN" trainer.total_steps=3 trainer.test_freq=3 trainer.save_freq=3 trainer.resume=never \
    > "$OUT/train_A.log" 2>&1 || { echo "agl train failed:"; tail -n 30 "$OUT/train_A.log"; FAILED+=("A-train"); }
[ -n "$TRACE_PID" ] && kill "$TRACE_PID" 2>/dev/null
cp "$RUN/metrics.jsonl" "$OUT/metrics_A.jsonl" 2>/dev/null
check A "$RUN"

phase "B. resume one step from step 3"
train trainer.run_dir="$RUN" trainer.total_steps=4 trainer.test_freq=0 trainer.save_freq=1 trainer.resume=auto \
    > "$OUT/train_B.log" 2>&1 || { echo "agl train failed:"; tail -n 30 "$OUT/train_B.log"; FAILED+=("B-train"); }
grep -q "resumed from .*global_step_3" "$OUT/train_B.log" || { echo "no 'resumed from ... global_step_3' in the log"; FAILED+=("B-resume"); }
check B "$RUN" --resumed-at 3

phase "C. LoRA: the served log-probs are the adapted policy's"
RUN_LORA=$WORK/run_lora
train trainer.run_dir="$RUN_LORA" trainer.total_steps=3 trainer.test_freq=0 trainer.save_freq=3 trainer.resume=never \
    plugins.lora.rank=8 plugins.lora.alpha=16 plugins.slots.compute_ref_logprob=lora \
    > "$OUT/train_C.log" 2>&1 || { echo "agl train failed:"; tail -n 30 "$OUT/train_C.log"; FAILED+=("C-train"); }
check C "$RUN_LORA"

if [ "$DEVICE" = cuda ]; then
    phase "D. GPU memory: the rollout servers' sleep frees it"
    $PY - "$OUT/gpu_memory.csv" "$RUN/config.yaml" <<'PY' || FAILED+=("D-memory")
import csv, sys
import yaml
rows = [(float(r[1]), float(r[2])) for r in csv.reader(open(sys.argv[1])) if len(r) == 3]
used = [u for u, _ in rows]
total = rows[0][1]
share = yaml.safe_load(open(sys.argv[2]))["plugins"]["verl"]["actor_rollout_ref"]["rollout"].get(
    "gpu_memory_utilization", 0.3)
peak = max(used)
first = used.index(peak)
low_after = min(used[first:])
step = max(1, len(used) // 40)
print("MiB used, every", step * 0.2, "s:", " ".join(f"{u:.0f}" for u in used[::step]))
print(f"peak {peak:.0f} MiB, lowest after it {low_after:.0f} MiB, the servers' share {share} of {total:.0f} MiB")
# The servers hold about share * total (weights and KV cache) awake; asleep they release it for training.
freed = peak - low_after
ok = freed >= 0.5 * share * total
print(f"freed {freed:.0f} MiB while asleep: {'PASS' if ok else 'FAIL'} (>= half of {share * total:.0f} MiB)")
sys.exit(0 if ok else 1)
PY
fi

phase "summary"
$PY - "$OUT/metrics_A.jsonl" <<'PY'
import json, sys
stages = ["gen", "gen_postprocess", "old_log_prob", "ref", "values", "adv", "update_actor", "step"]
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
rows = [row for row in rows if row["step"] > 0 and "timing_s/step" in row]
print(f"{'step':>4} " + " ".join(f"{s:>14}" for s in stages) + f" {'reward':>7} {'tis_mean':>8} {'mfu_infer':>9}")
for row in rows:
    cells = " ".join(f"{row.get(f'timing_s/{s}', float('nan')):>14.2f}" for s in stages)
    print(f"{row['step']:>4} {cells} {row.get('critic/score/mean_before_processing', float('nan')):>7.3f} "
          f"{row.get('rollout_corr/tis_mean', float('nan')):>8.4f} {row.get('perf/mfu/actor_infer', float('nan')):>9.4f}")
PY
echo "$((SECONDS - START)) s; results in $OUT"
if [ ${#FAILED[@]} -eq 0 ]; then echo "GPU SMOKE (verl): PASS"; exit 0; fi
echo "GPU SMOKE (verl): FAIL (${FAILED[*]})"
exit 1
