#!/usr/bin/env python
"""The Python half of scripts/gpu_smoke_embedded.sh: wheels, recipe, engine benchmark, summary.

    python scripts/gpu_smoke_embedded.py wheels WHEEL_DIR         # print the wheels this Python lacks
    python scripts/gpu_smoke_embedded.py recipe OUT.yaml DEVICE    # the GPU recipe of the default game
    python scripts/gpu_smoke_embedded.py bench OUT.json DEVICE BUDGET_S PARTS  # PARTS: dynamic,static,compiled,update
    python scripts/gpu_smoke_embedded.py summary RUN_DIR BENCH.json[,MORE.json] CHECK_RC OUT.json

The model is Qwen2.5-0.5B's shape (24 layers, width 896, 14 query and 2 key/value heads, MLP 4864, vocabulary
151936 rows, tied embeddings: 494M parameters) made from a config, with the default game's word tokenizer (its
other 151,9xx tokens decode to nothing). On ``cpu`` (the dry run of the tests) a model of the same kind at a
tiny width. Throughput is given as a share of the H200's dense bf16 rate (790 TFLOP/s): 2·N FLOPs a generated
token, 6·N a trained one (N parameters; attention's own FLOPs not counted).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PEAK_FLOPS = 790e12
"""The H200's dense bf16 tensor-core rate (FLOP/s) the shares are taken of."""

QWEN2_05B = {"architecture": "qwen2", "hidden_size": 896, "num_layers": 24, "num_heads": 14, "num_kv_heads": 2,
             "intermediate_size": 4864, "vocab_size": 151936, "max_position_embeddings": 1024}
TINY = {"architecture": "qwen2", "hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
        "intermediate_size": 128, "vocab_size": 4096, "max_position_embeddings": 1024}


def shape(device: str) -> dict:
    return QWEN2_05B if device == "cuda" else TINY


# ------------------------------------------------------------------ wheels


def missing_wheels(wheel_dir: Path) -> list[str]:
    """The wheels of ``wheel_dir`` whose distribution this Python lacks, or has at an older version."""
    from importlib import metadata

    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import Version

    out = []
    for wheel in sorted(wheel_dir.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(wheel.name)
        try:
            have = Version(metadata.version(canonicalize_name(name)))
        except metadata.PackageNotFoundError:
            have = None
        if have is None or have < version:
            out.append(str(wheel))
    return out


# ------------------------------------------------------------------ recipe


def write_recipe(out: Path, device: str) -> None:
    """The default game's recipe (examples/guess_number) on ``device`` with the benchmark's model."""
    import yaml

    recipe = yaml.safe_load((REPO / "examples/guess_number/recipe.yaml").read_text())
    recipe["plugins"].pop("tensorboard", None)  # tensorboard is not on the bare image; metrics.jsonl has it all
    build = recipe["plugins"]["torch"]["model"]["build"]
    recipe["plugins"]["torch"]["model"] = {
        "build": {**{k: v for k, v in build.items() if k == "vocabulary"}, **shape(device)},
        "device": device, "dtype": "bfloat16" if device == "cuda" else "float32"}
    recipe["plugins"]["torch"]["num_threads"] = None if device == "cuda" else 1
    recipe["plugins"]["torch"]["actor"] = {"lr": 1e-5 if device == "cuda" else 1e-3, "weight_decay": 0.0}
    # Every game of a step at once: the engine generates them as one batch.
    recipe["rollout"]["n_workers"] = recipe["data"]["train_batch_size"] * recipe["rollout"]["n"]
    out.write_text(yaml.safe_dump(recipe, sort_keys=False))


# ------------------------------------------------------------------ benchmark


def made_model(device: str):
    """The benchmark's model, made from its config on ``device`` (bf16 on a GPU), with the game's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    from agl_plugin_torch import modeling
    from agl_plugin_torch.settings import BuildConfig, ModelConfig

    vocabulary = ["1", "2", "3", "4", "5", "6", "7", "guess", "a", "number", "from", "to", "higher", "lower"]
    config = ModelConfig(build=BuildConfig(vocabulary=vocabulary, **shape(device)), device=device)
    tokenizer = modeling.word_tokenizer(vocabulary)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(modeling.model_config(config.build, tokenizer), dtype=dtype,
                                                 attn_implementation=modeling.attention_implementation(config))
    return model.eval(), tokenizer


def timed(fn, device: str) -> tuple[object, float]:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


def bench_generation(model, tokenizer, device: str, kv_cache: str, compiled: bool, rows: int, prompt: int,
                     new: int) -> dict:
    import torch

    from agl_plugin_torch.sampling import SamplingParams, generate

    n_params = sum(p.numel() for p in model.parameters())
    generator = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(7, len(tokenizer), (rows, prompt), generator=torch.Generator().manual_seed(0)).tolist()
    params = [SamplingParams(max_tokens=new, ignore_eos=True)] * rows
    decode_forward = torch.compile(model.forward, mode="reduce-overhead") if compiled else None

    def run(n):
        return generate(model, ids, [SamplingParams(max_tokens=n, ignore_eos=True)] * rows,
                        eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id,
                        decode=lambda _: "", generator=generator, kv_cache=kv_cache, decode_forward=decode_forward)

    _, warmup_s = timed(lambda: run(new if compiled else 4), device)  # a compiled step records its graphs here
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    samples, seconds = timed(lambda: generate(
        model, ids, params, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id,
        decode=lambda _: "", generator=generator, kv_cache=kv_cache, decode_forward=decode_forward), device)
    tokens = sum(len(s.token_ids) for s in samples)
    return {"kv_cache": kv_cache, "compiled": compiled, "rows": rows, "prompt_tokens": prompt, "new_tokens": new,
            "tokens": tokens, "seconds": seconds, "warmup_s": warmup_s, "tokens_per_s": tokens / seconds,
            "share_of_peak": 2 * n_params * tokens / seconds / PEAK_FLOPS, **memory(device)}


def bench_update(model, device: str, rows: int, prompt: int, response: int, micro: int) -> dict:
    import torch

    from agl_core.builtin.estimators import vanilla_policy_loss
    from agl_core.config import AlgorithmConfig
    from agl_core.data import Batch
    from agl_plugin_torch.settings import OptimConfig
    from agl_plugin_torch.training import make_optimizer, update_actor

    n_params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    width = prompt + response
    input_ids = torch.randint(7, 20, (rows, width), generator=g)
    attention_mask = torch.ones(rows, width, dtype=torch.long)
    columns = {"input_ids": input_ids, "attention_mask": attention_mask,
               "position_ids": torch.arange(width).expand(rows, width).clone(),
               "responses": input_ids[:, prompt:].clone(),
               "response_mask": torch.ones(rows, response, dtype=torch.long),
               "old_log_probs": torch.full((rows, response), -2.5),
               "advantages": torch.randn(rows, response, generator=g)}
    batch = Batch({key: value.to(device) for key, value in columns.items()})
    algorithm = AlgorithmConfig(ppo_mini_batch_size=rows, ppo_epochs=1)
    optim_config = OptimConfig(lr=1e-6, micro_batch_size=micro)
    optimizer, scheduler = make_optimizer([p for p in model.parameters() if p.requires_grad], optim_config)

    def run():
        return update_actor(model, optimizer, scheduler, batch, algorithm, vanilla_policy_loss, optim_config)

    _, warmup_s = timed(run, device)  # the optimizer's states are made here
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    metrics, seconds = timed(run, device)
    tokens = rows * width
    return {"rows": rows, "tokens_per_row": width, "micro_batch_rows": micro, "tokens": tokens,
            "seconds": seconds, "warmup_s": warmup_s, "tokens_per_s": tokens / seconds,
            "share_of_peak": 6 * n_params * tokens / seconds / PEAK_FLOPS,
            "grad_norm": metrics["actor/grad_norm"], **memory(device)}


def memory(device: str) -> dict:
    import torch

    if device != "cuda":
        return {}
    return {"peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}


VARIANTS = {"dynamic": ("dynamic", False, 0), "static": ("static", False, 30), "compiled": ("static", True, 120)}
"""Generation variants: KV cache, compiled decode step, seconds they need left to be started."""


def bench(out: Path, device: str, budget_s: float, parts: list[str]) -> int:
    """The parts asked for among generation variants (:data:`VARIANTS`) and ``update``; JSON to ``out``.

    A failure of ``dynamic`` (the default path) or ``update`` is exit 1; the
    others are reported as they went, skipped when the time left is short.
    """
    import torch

    start = time.monotonic()
    if device == "cpu":
        torch.set_num_threads(1)  # the dry run: a busy machine's cores
    model, tokenizer = made_model(device)
    n_params = sum(p.numel() for p in model.parameters())
    big = device == "cuda"
    rows, prompt, new = (256, 64, 256) if big else (8, 8, 8)
    results: dict = {"device": torch.cuda.get_device_name() if big else "cpu", "parameters": n_params,
                     "dtype": str(next(model.parameters()).dtype), "attention": model.config._attn_implementation,
                     "torch": torch.__version__, "generation": [], "update": None, "errors": {}}

    def save():
        out.write_text(json.dumps(results, indent=1))

    code = 0
    for name in [part for part in parts if part in VARIANTS]:
        kv_cache, compiled, needs_s = VARIANTS[name]
        if compiled and not big:
            results["errors"][name] = "skipped: CUDA graphs, nothing to learn on a CPU"
            continue
        if time.monotonic() - start > budget_s - needs_s:
            results["errors"][name] = "skipped: not enough time left"
            continue
        try:
            results["generation"].append(bench_generation(model, tokenizer, device, kv_cache, compiled, rows, prompt,
                                                          new))
        except Exception as exc:  # reported; only the default path's failure fails the smoke
            results["errors"][name] = f"{type(exc).__name__}: {exc}"[:2000]
            code = 1 if kv_cache == "dynamic" else code
        save()
        if compiled:
            torch._dynamo.reset()
    try:
        if "update" not in parts:
            raise LookupError
        model.train()
        results["update"] = bench_update(model, device, *((32, 64, 448, 8) if big else (4, 8, 8, 2)))
    except LookupError:
        pass
    except Exception as exc:
        results["errors"]["update"] = f"{type(exc).__name__}: {exc}"[:2000]
        code = 1
    results["seconds"] = time.monotonic() - start
    save()
    return code


# ------------------------------------------------------------------ summary


def summary(run_dir: Path, bench_files: list[Path], check_rc: int, out: Path) -> int:
    """The run's and the benchmarks' figures, as JSON to ``out`` and a compact table on stdout."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if r["step"] >= 1 and "timing_s/step" in r]
    bench_results: dict = {"generation": [], "errors": {}}
    for path in bench_files:
        if not path.is_file():
            bench_results["errors"][path.name] = "no results (the benchmark did not start, or was killed)"
            continue
        part = json.loads(path.read_text())
        generation, errors = part.pop("generation", []), part.pop("errors", {})
        bench_results["generation"] += generation
        bench_results["errors"].update(errors)
        bench_results.update({k: v for k, v in part.items() if v is not None or k not in bench_results})
    n_params = bench_results.get("parameters")
    stages = ["gen", "gen_postprocess", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor",
              "step"]
    epochs = _config(run_dir).get("algorithm", {}).get("ppo_epochs", 1)  # each row is trained on once an epoch
    run: dict = {"steps": []}
    for r in steps:
        gen_tokens, gen_wall = r.get("perf/gen_engine_tokens", 0.0), r.get("perf/gen_engine_wall_s", 0.0)
        update_tokens = r.get("perf/total_num_tokens", 0.0) * epochs
        entry = {"step": r["step"], **{f"timing_s/{s}": r[f"timing_s/{s}"] for s in stages if f"timing_s/{s}" in r},
                 "gen_engine_tokens": gen_tokens, "gen_engine_wall_s": gen_wall,
                 "gen_tokens_per_s": gen_tokens / gen_wall if gen_wall else None,
                 "update_tokens_per_s": update_tokens / r["timing_s/update_actor"]
                 if r.get("timing_s/update_actor") else None,
                 "peak_allocated_gib": r.get("perf/max_memory_allocated_gb"),
                 "tis_mean": r.get("rollout_corr/tis_mean"), "tis_max": r.get("rollout_corr/tis_max"),
                 "reward": r.get("critic/score/mean_before_processing")}
        if n_params:
            for key, flops in (("gen_tokens_per_s", 2), ("update_tokens_per_s", 6)):
                if entry[key]:
                    entry[key.replace("tokens_per_s", "share_of_peak")] = flops * n_params * entry[key] / PEAK_FLOPS
        run["steps"].append(entry)
    result = {"check_run_rc": check_rc, "run": run, "bench": bench_results, "peak_flops": PEAK_FLOPS}
    out.write_text(json.dumps(result, indent=1))

    print("\n=== gpu_smoke_embedded summary ===")
    print(f"device {bench_results.get('device')}  torch {bench_results.get('torch')}  "
          f"params {n_params}  dtype {bench_results.get('dtype')}  attention {bench_results.get('attention')}")
    print(f"training run ({run_dir.name}): check_run rc={check_rc}")
    print(f"{'step':>4} {'gen_s':>6} {'post_s':>6} {'oldlp_s':>7} {'adv_s':>6} {'upd_s':>6} {'step_s':>6} "
          f"{'gen_tok':>7} {'gen_tok/s':>9} {'gen%pk':>7} {'upd_tok/s':>9} {'upd%pk':>7} {'peakGiB':>7} "
          f"{'tis_mean':>8} {'tis_max':>7}")
    for e in run["steps"]:
        def f(key, fmt):
            value = e.get(key)
            return format(value, fmt) if isinstance(value, (int, float)) and math.isfinite(value) else "-"
        print(f"{e['step']:>4} {f('timing_s/gen', '6.2f')} {f('timing_s/gen_postprocess', '6.2f')} "
              f"{f('timing_s/old_log_prob', '7.2f')} {f('timing_s/adv', '6.3f')} {f('timing_s/update_actor', '6.2f')} "
              f"{f('timing_s/step', '6.2f')} {f('gen_engine_tokens', '7.0f')} {f('gen_tokens_per_s', '9.0f')} "
              f"{100 * e['gen_share_of_peak'] if e.get('gen_share_of_peak') else float('nan'):>6.2f}% "
              f"{f('update_tokens_per_s', '9.0f')} "
              f"{100 * e['update_share_of_peak'] if e.get('update_share_of_peak') else float('nan'):>6.2f}% "
              f"{f('peak_allocated_gib', '7.2f')} {f('tis_mean', '8.4f')} {f('tis_max', '7.3f')}")
    print("engine benchmark (generate() alone; update_actor alone):")
    for g in bench_results.get("generation", []):
        print(f"  generate {g['kv_cache']:>7}{'+compiled' if g['compiled'] else '':9} {g['rows']}x{g['new_tokens']} "
              f"new tokens: {g['tokens_per_s']:10.0f} tok/s = {100 * g['share_of_peak']:6.2f}% of peak, "
              f"{g['seconds']:.2f} s (warm-up {g['warmup_s']:.1f} s), peak {g.get('peak_allocated_gib', 0):.2f} GiB")
    if u := bench_results.get("update"):
        print(f"  update   {u['rows']}x{u['tokens_per_row']} tokens, micro-batch {u['micro_batch_rows']}: "
              f"{u['tokens_per_s']:10.0f} tok/s = {100 * u['share_of_peak']:6.2f}% of peak, {u['seconds']:.2f} s, "
              f"peak {u.get('peak_allocated_gib', 0):.2f} GiB")
    for name, error in bench_results.get("errors", {}).items():
        print(f"  {name}: {error.splitlines()[0][:300] if error else error}")
    return 0


def _config(run_dir: Path) -> dict:
    import yaml

    return yaml.safe_load((run_dir / "config.yaml").read_text()) or {}


def main(argv: list[str]) -> int:
    command, *args = argv
    if command == "wheels":
        print("\n".join(missing_wheels(Path(args[0]))))
        return 0
    if command == "recipe":
        write_recipe(Path(args[0]), args[1])
        return 0
    if command == "bench":
        return bench(Path(args[0]), args[1], float(args[2]), args[3].split(","))
    if command == "summary":
        return summary(Path(args[0]), [Path(a) for a in args[1].split(",")], int(args[2]), Path(args[3]))
    raise SystemExit(f"unknown command {command!r}: wheels, recipe, bench or summary")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
