"""Several policies on one base model: serving a batch of 4 adapters, their memory, and learning the two-role game.

Three parts, one JSON line with every figure:

* **Serving** (``mixed_vs_single``, the goal is >= 0.75): tokens/s of one
  generation batch (the embedded backend's own ``generate``) whose rows use 4
  different LoRA adapters, computed in one forward per token with per-row
  adapters (the batched per-row LoRA kernel, what the endpoint does), against
  the same batch on one adapter (a plain forward, no routing). Two
  alternatives the engine does not take, for reference: ``peft_mixed``, peft's
  own mixed-adapter batch (``adapter_names``: a loop over the adapters in every
  layer; ``peft_mixed_vs_single``), and ``grouped``, the batch cut into one
  sub-batch per adapter, generated one after the other (``grouped_vs_single``).
* **Memory** (each side in a fresh process; Linux ``/proc``): the peak resident
  set of the base model generating the batch, and of the model with 4 adapters
  generating the mixed batch. The bound is ``(base + 4 x one adapter's bytes) x
  1.10``; ``base_held_once`` says that the adapted model's base weights are
  the tensors loaded, not copies, and ``adapters_held_once`` that the
  adapters' storage (the per-row kernel's stacked matrices) is 4 adapters'
  bytes, not more.
* **Learning** (``--learning``; minutes per seed): ``examples/two_roles`` with
  both roles trained, and with the guesser frozen beside it, on each seed of
  ``--seeds``: the step and seconds at which validation reward first reaches
  ``--goal``, and the final validation reward. The recipe is the same for
  every seed. A short run: ``--steps 20 --seeds 0``.

    python benchmarks/bench_multi_policy.py [--hidden 256] [--layers 4] [--vocab 2000] [--rank 8] [--rows 16]
        [--new-tokens 32] [--threads 2] [--learning [--seeds 0 1 2] [--steps 80] [--goal 0.8]]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from procmem import reset_peak, status_bytes

ADAPTERS = ["a0", "a1", "a2", "a3"]
ROOT = Path(__file__).resolve().parent.parent


def make_model(args, run_dir: Path, adapters: int):
    """The embedded backend's model made from a config, with ``adapters`` named LoRA adapters (B moved off zero)."""
    from types import SimpleNamespace

    from agl_core.config import validate_recipe
    from agl_plugin_torch.backend import create
    from agl_plugin_torch.settings import TorchConfig

    from agl_plugin_lora.embedded import adapt_actor
    from agl_plugin_lora.settings import LoraSettings

    section = {"model": {"build": {"vocabulary": [f"w{i}" for i in range(args.vocab)], "hidden_size": args.hidden,
                                   "num_layers": args.layers, "num_heads": args.heads,
                                   "max_position_embeddings": 256}},
               "num_threads": args.threads}
    transforms = []
    if adapters:
        recipe = validate_recipe({"policies": {name: {} for name in ADAPTERS[:adapters]}})
        ctx = SimpleNamespace(slots={}, config=recipe,
                              plugin_config=lambda name: LoraSettings(rank=args.rank, alpha=2 * args.rank))
        transforms.append(lambda actor: adapt_actor(actor, ctx))
    backend = create(TorchConfig.model_validate(section), run_dir, seed=0, with_critic=False, transforms=transforms)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in backend.actor.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.02, generator=gen)
    return backend


def generate_batch(backend, args, adapters, route=None):
    """Tokens and seconds of generating the batch, row i through ``adapters[i]`` by ``route`` (the engine's)."""
    from agl_plugin_torch.policies import adapters_per_row
    from agl_plugin_torch.sampling import SamplingParams, generate

    gen = torch.Generator().manual_seed(2)
    prompts = torch.randint(4, args.vocab, (len(adapters) if adapters else args.rows, 16), generator=gen).tolist()
    params = [SamplingParams(max_tokens=args.new_tokens, temperature=1.0, ignore_eos=True, seed=i)
              for i in range(len(prompts))]
    tok = backend.tokenizer
    with (route or adapters_per_row)(backend.actor, adapters if adapters and len(set(adapters)) > 1 else None):
        start = time.perf_counter()
        samples = generate(backend.actor, prompts, params, eos_token_ids=[tok.eos_token_id],
                           pad_token_id=tok.pad_token_id, decode=lambda ids: "", generator=gen)
        seconds = time.perf_counter() - start
    return sum(len(s.token_ids) for s in samples), seconds


def serving(args) -> dict:
    from agl_plugin_torch.policies import peft_adapters_per_row

    with tempfile.TemporaryDirectory() as tmp:
        backend = make_model(args, Path(tmp), adapters=4)
        backend.actor.set_adapter("a0")  # the single-adapter side: a plain forward through one active adapter
        mixed_rows = [ADAPTERS[i % 4] for i in range(args.rows)]
        generate_batch(backend, args, mixed_rows)  # warm-up
        generate_batch(backend, args, mixed_rows, route=peft_adapters_per_row)
        figures = {"mixed": [], "single": [], "peft_mixed": [], "grouped": []}
        for _ in range(args.repeats):
            tokens, seconds = generate_batch(backend, args, mixed_rows)
            figures["mixed"].append(tokens / seconds)
            tokens, seconds = generate_batch(backend, args, mixed_rows, route=peft_adapters_per_row)
            figures["peft_mixed"].append(tokens / seconds)
            tokens, seconds = generate_batch(backend, args, None)
            figures["single"].append(tokens / seconds)
            total_tokens, total_s = 0, 0.0
            for name in ADAPTERS:  # one sub-batch per adapter, one after the other
                backend.actor.set_adapter(name)
                tokens, seconds = generate_batch(backend, args, [name] * (args.rows // 4))
                total_tokens, total_s = total_tokens + tokens, total_s + seconds
            backend.actor.set_adapter("a0")
            figures["grouped"].append(total_tokens / total_s)
    best = {k: max(v) for k, v in figures.items()}
    return {"mixed_tokens_per_s": best["mixed"], "single_tokens_per_s": best["single"],
            "peft_mixed_tokens_per_s": best["peft_mixed"], "grouped_tokens_per_s": best["grouped"],
            "mixed_vs_single": best["mixed"] / best["single"],
            "peft_mixed_vs_single": best["peft_mixed"] / best["single"],
            "grouped_vs_single": best["grouped"] / best["single"]}


def memory_side(args) -> dict:
    """In this (fresh) process: peak RSS of the model (0 or 4 adapters) generating the batch."""
    with tempfile.TemporaryDirectory() as tmp:
        tiny = argparse.Namespace(**{**vars(args), "hidden": 32, "layers": 1, "heads": 2, "vocab": 64})
        warm = make_model(tiny, Path(tmp) / "tiny", adapters=args.adapters)
        generate_batch(warm, tiny, [ADAPTERS[i % 4] for i in range(4)] if args.adapters else None)
        del warm
        reset_peak()
        backend = make_model(args, Path(tmp) / "model", adapters=args.adapters)
        rows = [ADAPTERS[i % 4] for i in range(args.rows)] if args.adapters else None
        generate_batch(backend, args, rows)
        from safetensors import safe_open

        with safe_open(str(backend.source / "model.safetensors"), "pt") as f:
            base_params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
        held = sum(p.numel() for n, p in backend.actor.named_parameters() if "lora_" not in n)
        one_adapter = sum(p.numel() * p.element_size() for n, p in backend.actor.named_parameters()
                          if ".a0." in n)
        # The adapters' storage: the per-row kernel's stacked matrices, which the adapters' parameters are views of.
        stored = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                  for n, p in backend.actor.named_parameters() if "lora_" in n}
        return {"peak_bytes": status_bytes("VmHWM"), "base_params_in_file": base_params, "base_params_held": held,
                "one_adapter_bytes": one_adapter, "adapter_bytes_held": sum(stored.values())}


def memory(args) -> dict:
    sides = {}
    for adapters in (0, 4):
        out = subprocess.run([sys.executable, __file__, "--memory-side", "--adapters", str(adapters),
                              *sys.argv[1:]], capture_output=True, text=True, check=True, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                                                              os.environ.get("PYTHONPATH", "")])})
        sides[adapters] = json.loads(out.stdout.strip().splitlines()[-1])
    base, multi = sides[0], sides[4]
    bound = (base["peak_bytes"] + 4 * multi["one_adapter_bytes"]) * 1.10
    return {"base_peak_bytes": base["peak_bytes"], "four_adapters_peak_bytes": multi["peak_bytes"],
            "one_adapter_bytes": multi["one_adapter_bytes"], "memory_bound_bytes": int(bound),
            "memory_within_bound": multi["peak_bytes"] <= bound,
            "base_held_once": multi["base_params_held"] == base["base_params_in_file"],
            "adapters_held_once": multi["adapter_bytes_held"] == 4 * multi["one_adapter_bytes"]}


def learn(seed: int, args, frozen: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"trainer.seed={seed}", f"trainer.total_steps={args.steps}", f"trainer.run_dir={tmp}/run",
                     "trainer.save_freq=0", "trainer.progress=false"]
        overrides += ["policies.guesser.trainable=false"] if frozen else []
        start = time.time()
        subprocess.run(["agl", "train", "examples/two_roles/recipe.yaml", *overrides], cwd=ROOT, check=True,
                       capture_output=True, text=True)
        wall = time.time() - start
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    val = [(r["step"], r["val/reward/mean"]) for r in rows if "val/reward/mean" in r]
    reached = next((step for step, reward in val if reward >= args.goal), None)
    # Seconds of training to the goal: the steps' own times (timing_s/step) up to that step.
    seconds = None if reached is None else sum(r.get("timing_s/step", 0.0) for r in rows if r["step"] <= reached)
    return {"seed": seed, "reached_at_step": reached, "seconds_to_goal": seconds,
            "final_val_reward": val[-1][1] if val else None, "run_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2000)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--learning", action="store_true")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=80, help="training steps of every run (the recipe's 80)")
    parser.add_argument("--goal", type=float, default=0.8)
    parser.add_argument("--memory-side", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--adapters", type=int, default=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_side:
        print(json.dumps(memory_side(args)))
        return
    out = {"bench": "multi_policy", "hidden": args.hidden, "layers": args.layers, "vocab": args.vocab,
           "rank": args.rank, "rows": args.rows, "new_tokens": args.new_tokens, "adapters": len(ADAPTERS)}
    out.update(serving(args))
    out.update(memory(args))
    if args.learning:
        out["learning_goal"] = args.goal
        out["learning_both_trained"] = [learn(seed, args, frozen=False) for seed in args.seeds]
        out["learning_guesser_frozen"] = [learn(seed, args, frozen=True) for seed in args.seeds]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
