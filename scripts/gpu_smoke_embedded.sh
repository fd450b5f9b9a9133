#!/usr/bin/env bash
# The embedded backend (agl-plugin-torch) on one GPU, on a bare image: Python 3.12 with torch (CUDA),
# transformers, peft, accelerate, numpy, httpx, rich, tqdm, uvloop and pluggy, nothing downloadable.
#
#   on a machine with a package registry:  scripts/fetch_gpu_wheels.sh      (-> gpu_wheels/, ~9 MiB)
#   on the GPU machine, in the checkout:   scripts/gpu_smoke_embedded.sh    (gpu_wheels/ carried along)
#
# 1. installs the wheels of gpu_wheels/ that the image lacks (pip --no-index --no-deps --target), and makes
#    agl_core and its plugins importable and discoverable from the checkout (scripts/source_dists.py: no build);
# 2. trains the default game (examples/guess_number) for a few steps with a Qwen2.5-0.5B-shaped model made
#    from a config, bf16, on CUDA, and checks the run with scripts/check_run.py (--no-learning: a random 0.5B
#    model never wins the game, so its rewards are all 0 and its updates are zero; the rest is checked);
# 3. benchmarks the engine's generate() (dynamic KV cache, static, static + CUDA graphs) and update_actor
#    alone, at sizes that fill the GPU better than the game does;
# 4. prints a summary (stage times, tokens/s and their share of the H200's 790 TFLOP/s bf16, peak memory) and
#    writes it as JSON, with the run's metrics, under $OUT (when set; else runs/gpu_smoke_embedded_out).
#
# Exit 0: pass; 1: fail (the run or its check failed, or the default generation path); 2: unusable (no GPU,
# the wheels do not install, agl_core does not import). AGL_SMOKE_DEVICE=cpu is the dry run the tests run
# (tiny model, same code). It keeps to AGL_SMOKE_BUDGET_S seconds (default 400) of its own.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
DEVICE=${AGL_SMOKE_DEVICE:-cuda}
BUDGET_S=${AGL_SMOKE_BUDGET_S:-400}
OUT=${OUT:-$REPO/runs/gpu_smoke_embedded_out}
WORK=${AGL_SMOKE_WORK:-$(mktemp -d /tmp/agl_gpu_smoke.XXXXXX)}
WHEELS=${WHEELS:-$REPO/gpu_wheels}
STEPS=${AGL_SMOKE_STEPS:-$([ "$DEVICE" = cuda ] && echo 4 || echo 2)}
START=$SECONDS
mkdir -p "$OUT" "$WORK"
PY=${PYTHON:-python3}
left() { echo $((BUDGET_S - (SECONDS - START))); }
unusable() { echo "UNUSABLE: $*" | tee -a "$OUT/summary.txt"; exit 2; }

echo "=== environment"
$PY -c 'import sys; print(sys.version)'
[ "$DEVICE" = cuda ] && { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true; }

echo "=== 1. wheels and sources"
SITE=$WORK/site
mkdir -p "$SITE"
if [ -d "$WHEELS" ]; then
    mapfile -t NEED < <($PY scripts/gpu_smoke_embedded.py wheels "$WHEELS") || unusable "cannot read $WHEELS"
    if [ ${#NEED[@]} -gt 0 ]; then
        echo "installing ${#NEED[@]} wheels the image lacks: $(for w in "${NEED[@]}"; do basename "$w" | cut -d- -f1; done | tr '\n' ' ')"
        # Without pip a wheel is unpacked as it is (what an install of a wheel without .data amounts to).
        $PY -m pip install -q --no-index --no-deps --target "$SITE" "${NEED[@]}" \
            || $PY -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
                "$SITE" "${NEED[@]}" || unusable "the wheels of $WHEELS do not install"
    else
        echo "the image has every distribution of $WHEELS"
    fi
else
    echo "no $WHEELS (scripts/fetch_gpu_wheels.sh makes it): using what this Python has"
fi
# The checkout's own distributions: from source, with their entry points, unless already installed.
if ! $PY -c 'import importlib.metadata as m; m.version("agl-core")' 2>/dev/null; then
    SOURCES=$($PY scripts/source_dists.py "$SITE" "$REPO" "$REPO"/plugins/agl-plugin-{torch,traces,sqlite}) \
        || unusable "scripts/source_dists.py failed"
    export PYTHONPATH="$SOURCES:$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
$PY - "$DEVICE" <<'PY' || unusable "the embedded backend does not import, or no GPU"
import importlib.metadata as md, sys
import torch, transformers, agl_core.cli, agl_plugin_torch.backend, agl_plugin_traces, agl_plugin_sqlite, openai
eps = {ep.name for ep in md.entry_points(group="agl_core.plugins")}
assert {"torch", "traces", "sqlite", "estimators", "local_runner"} <= eps, f"plugins not discoverable: {sorted(eps)}"
print(f"torch {torch.__version__} (cuda {torch.version.cuda}), transformers {transformers.__version__}, "
      f"openai {openai.__version__}; plugins {sorted(eps)}")
if sys.argv[1] == "cuda":
    assert torch.cuda.is_available(), "torch sees no CUDA GPU"
    print(torch.cuda.get_device_name(), f"bf16 {torch.cuda.is_bf16_supported()}")
PY
echo "[$((SECONDS - START)) s]"

echo "=== 2. the default game, $STEPS steps, on $DEVICE"
RUN_DIR=$WORK/run
$PY scripts/gpu_smoke_embedded.py recipe "$WORK/recipe.yaml" "$DEVICE" || exit 1
TRAIN_S=$(( $(left) * 55 / 100 ))
timeout "$TRAIN_S" $PY -m agl_core.cli train "$WORK/recipe.yaml" trainer.run_dir="$RUN_DIR" \
    trainer.total_steps="$STEPS" trainer.test_freq="$STEPS" trainer.save_freq="$STEPS" trainer.progress=false \
    $([ "$DEVICE" = cpu ] && echo rollout.n=4 algorithm.ppo_mini_batch_size=8) > "$OUT/train.log" 2>&1
TRAIN_RC=$?
tail -n 25 "$OUT/train.log"
cp "$RUN_DIR"/{metrics.jsonl,config.yaml,run.json} "$OUT"/ 2>/dev/null
echo "agl train rc=$TRAIN_RC [$((SECONDS - START)) s]"
CHECK_RC=1
if [ $TRAIN_RC -eq 0 ]; then
    $PY scripts/check_run.py "$RUN_DIR" --no-learning | tee "$OUT/check_run.txt"
    CHECK_RC=${PIPESTATUS[0]}
fi

echo "=== 3. engine benchmark"
# The default generation path and the update must work; CUDA graphs (compiled decode) run last, in a process of
# their own, with what time is left: their failure or time-out is reported, not a failure of the smoke.
BENCH_S=$(( $(left) * 45 / 100 ))
[ $BENCH_S -gt 30 ] || BENCH_S=30
timeout $((BENCH_S + 15)) $PY scripts/gpu_smoke_embedded.py bench "$OUT/bench.json" "$DEVICE" "$BENCH_S" \
    dynamic,static,update > "$OUT/bench.log" 2>&1
BENCH_RC=$?
tail -n 5 "$OUT/bench.log"
BENCH_FILES=$OUT/bench.json
if [ "$DEVICE" = cuda ] && [ "$(left)" -gt 60 ]; then
    timeout $(( $(left) - 20 )) $PY scripts/gpu_smoke_embedded.py bench "$OUT/bench_compiled.json" "$DEVICE" \
        $(( $(left) - 25 )) compiled > "$OUT/bench_compiled.log" 2>&1
    echo "compiled decode benchmark rc=$? (not part of pass/fail)"
    tail -n 3 "$OUT/bench_compiled.log"
    BENCH_FILES=$BENCH_FILES,$OUT/bench_compiled.json
fi

echo "=== 4. summary [$((SECONDS - START)) s]"
if [ -f "$RUN_DIR/metrics.jsonl" ]; then
    $PY scripts/gpu_smoke_embedded.py summary "$RUN_DIR" "$BENCH_FILES" "$CHECK_RC" "$OUT/gpu_smoke_embedded.json" \
        | tee "$OUT/summary.txt"
fi
grep -E "^(FAIL|PASS)" "$OUT/check_run.txt" 2>/dev/null | grep FAIL
echo "agl train rc=$TRAIN_RC, check_run rc=$CHECK_RC, bench rc=$BENCH_RC, $((SECONDS - START)) s in all; results in $OUT"
[ $TRAIN_RC -eq 0 ] && [ $CHECK_RC -eq 0 ] && [ $BENCH_RC -eq 0 ] && { echo "GPU SMOKE (embedded): PASS"; exit 0; }
echo "GPU SMOKE (embedded): FAIL"
exit 1
