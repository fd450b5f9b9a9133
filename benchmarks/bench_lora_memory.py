"""Peak memory of a training step: LoRA with the reference in the actor versus full fine-tuning with a reference copy.

Both modes run the embedded backend's own code (agl-plugin-torch) on the
same model, made from a config (a llama of about 70M parameters by default,
float32 on the CPU), and the same batch of random rows. One step is what the
loop does with a KL loss: the old log-probs, the reference log-probs, then
one PPO update (one mini-batch, one epoch) of the actor.

* ``full``: the backend as it is: AdamW over every weight, and the reference
  policy a frozen copy of the initial weights that it loads on first use.
* ``lora``: the actor adapted by agl-plugin-lora (rank 8 on every linear
  layer): AdamW over the adapter only, and the reference log-probs the
  actor's with the adapter disabled; no copy.

Each mode runs in a fresh process (so neither inherits the other's heap)
and takes two steps of the same batch. The figure compared is the second
step's peak: the kernel's high-water mark of the resident set (``VmHWM``),
reset just before the step by writing ``5`` to ``/proc/self/clear_refs``. It
counts the model already resident plus everything the step adds (gradients,
optimizer state, activations) and, in the full mode, the reference copy held
since the first step. The first step pays one-off costs that a run pays once
and that are not compared: the weights, memory-mapped by ``from_pretrained``,
become resident; the full mode loads its reference (``from_pretrained`` then
a deep copy: two copies for a moment); AdamW makes its state. Its peak is
reported too (``*_first_step_peak_bytes``). ``runtime_bytes`` is the resident
set before the model is made (Python, torch, transformers and a warm-up step
on a tiny model: about 400 MB, the same in both modes). Prints one JSON
line, with the model's size (``params``, ``hidden``, ``layers``, ``vocab``):

    {"bench": "lora_memory", "params": ..., "hidden": ..., "layers": ..., "vocab": ..., "dtype": "float32",
     "rows": ..., "micro_batch": ..., "prompt_tokens": ..., "response_tokens": ..., "rank": ...,
     "lora_trainable_params": ..., "full_runtime_bytes": ..., "full_first_step_peak_bytes": ...,
     "full_step_peak_bytes": ..., "full_step_s": ..., "lora_runtime_bytes": ..., "lora_first_step_peak_bytes": ...,
     "lora_step_peak_bytes": ..., "lora_step_s": ..., "peak_ratio": ..., "saving": ...,
     "saving_first_step": ..., "saving_over_runtime": ...}

``peak_ratio`` is ``lora_step_peak_bytes / full_step_peak_bytes`` and
``saving`` is ``1 - peak_ratio`` (the target is >= 0.4);
``saving_over_runtime`` is the same over what the model and its step add to
the runtime (``step_peak_bytes - runtime_bytes``).
Linux only (``/proc/self/status`` and ``clear_refs``).

    python benchmarks/bench_lora_memory.py [--hidden 640] [--layers 10] [--heads 10] [--vocab 8000] [--rank 8]
        [--rows 8] [--micro-batch 2] [--prompt 64] [--response 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from procmem import reset_peak, status_bytes


def random_rows(vocab: int, rows: int, prompt: int, response: int, seed: int = 0):
    from agl_core.data import Batch

    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(8, vocab, (rows, prompt), generator=gen)
    responses = torch.randint(8, vocab, (rows, response), generator=gen)
    mask = torch.ones(rows, prompt + response, dtype=torch.long)
    return Batch({"prompts": prompts, "responses": responses, "response_mask": torch.ones_like(responses),
                  "input_ids": torch.cat([prompts, responses], dim=1), "attention_mask": mask,
                  "position_ids": torch.arange(prompt + response).expand(rows, -1).clone(),
                  "advantages": torch.randn(rows, response, generator=gen)},
                 {"uid": np.array([f"t{i // 4}" for i in range(rows)], dtype=object)})


def make_backend(mode: str, args: argparse.Namespace, run_dir: Path, hidden: int, layers: int, heads: int):
    """The embedded backend of a llama made from a config; with ``mode == "lora"`` its actor adapted.

    The adapter goes on through the backend's actor transform point, as in a
    run with ``plugins.lora``: the optimizer is only ever made over it.
    """
    from types import SimpleNamespace

    from agl_core.config import Recipe
    from agl_plugin_torch.backend import create
    from agl_plugin_torch.settings import TorchConfig

    from agl_plugin_lora.embedded import adapt_actor
    from agl_plugin_lora.settings import LoraSettings

    section = {"model": {"build": {"vocabulary": [f"w{i}" for i in range(args.vocab)], "hidden_size": hidden,
                                   "num_layers": layers, "num_heads": heads, "max_position_embeddings": 512},
                         "dtype": "float32", "device": "cpu"},
               "actor": {"lr": 1e-5, "micro_batch_size": args.micro_batch}, "num_threads": args.threads,
               "forward_micro_batch_size": args.micro_batch}
    transforms = []
    if mode == "lora":
        ctx = SimpleNamespace(slots={}, plugin_config=lambda name: LoraSettings(rank=args.rank, alpha=2 * args.rank),
                              config=Recipe())
        transforms.append(lambda actor: adapt_actor(actor, ctx))
    return create(TorchConfig.model_validate(section), run_dir, seed=0, with_critic=False, transforms=transforms)


def step(mode: str, backend, batch, rows: int) -> None:
    """What the loop does with a KL loss: old log-probs, reference log-probs, one PPO update."""
    from agl_core.builtin.estimators import vanilla_policy_loss
    from agl_core.config import AlgorithmConfig
    from agl_plugin_torch import training

    from agl_plugin_lora.embedded import reference_logprobs

    algorithm = AlgorithmConfig(ppo_mini_batch_size=rows, ppo_epochs=1,
                                policy_loss={"use_kl_loss": True, "kl_loss_coef": 0.01})
    batch["old_log_probs"] = backend.logprobs(backend.actor, batch, with_entropy=False)[0]
    batch["ref_log_prob"] = (reference_logprobs(backend, batch) if mode == "lora" else
                             backend.logprobs(backend.reference(), batch, with_entropy=False)[0])
    training.update_actor(backend.actor, backend.actor_optim, backend.actor_sched, batch, algorithm,
                          vanilla_policy_loss, backend.config.actor)


def measure(mode: str, args: argparse.Namespace) -> dict:
    """Two training steps of ``mode`` in this process; the peak RSS and time of each.

    A step of the same mode on a tiny model comes first: the first use of each
    kernel pages in code of libtorch and makes one-time buffers, hundreds of
    MB of resident set that are no part of what the step's size costs. The
    first step of the real model pays one-off costs: the weights, memory-mapped
    by ``from_pretrained``, become resident; the full mode loads its reference
    (``from_pretrained`` then a deep copy: two copies for a moment); AdamW makes
    its state. The second step is what every later step of a run costs, and
    is the figure compared.
    """
    with tempfile.TemporaryDirectory() as tmp:
        tiny = make_backend(mode, args, Path(tmp) / "tiny", hidden=32, layers=1, heads=2)
        step(mode, tiny, random_rows(len(tiny.tokenizer), args.rows, args.prompt, args.response), args.rows)
        del tiny
        runtime = status_bytes("VmRSS")
        backend = make_backend(mode, args, Path(tmp) / "model", args.hidden, args.layers, args.heads)
        batch = random_rows(len(backend.tokenizer), args.rows, args.prompt, args.response)
        figures = {}
        for name in ("first_step", "step"):
            figures[f"{name}_rss_before_bytes"] = status_bytes("VmRSS")
            reset_peak()
            start = time.perf_counter()
            step(mode, backend, batch, args.rows)
            figures[f"{name}_s"] = round(time.perf_counter() - start, 3)
            figures[f"{name}_peak_bytes"] = status_bytes("VmHWM")
    return {"params": sum(p.numel() for n, p in backend.actor.named_parameters() if "lora_" not in n),
            "trainable": sum(p.numel() for p in backend.actor.parameters() if p.requires_grad),
            "runtime_bytes": runtime, **figures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=640)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--heads", type=int, default=10)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=2, help="rows per forward/backward (both modes)")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mode", choices=["full", "lora"], help=argparse.SUPPRESS)  # a child process's one mode
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(measure(args.mode, args)))
        return
    results = {}
    for mode in ("full", "lora"):
        child = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--mode", mode], check=True,
                               capture_output=True, text=True)
        results[mode] = json.loads(child.stdout.strip().splitlines()[-1])
    full, lora = results["full"], results["lora"]
    print(json.dumps({"bench": "lora_memory", "params": full["params"], "hidden": args.hidden, "layers": args.layers,
                      "vocab": args.vocab, "dtype": "float32", "rows": args.rows, "micro_batch": args.micro_batch,
                      "prompt_tokens": args.prompt, "response_tokens": args.response, "rank": args.rank,
                      "lora_trainable_params": lora["trainable"],
                      **{f"{mode}_{key}": value for mode in ("full", "lora")
                         for key, value in results[mode].items() if key not in ("params", "trainable")},
                      "peak_ratio": round(lora["step_peak_bytes"] / full["step_peak_bytes"], 3),
                      "saving": round(1 - lora["step_peak_bytes"] / full["step_peak_bytes"], 3),
                      "saving_first_step": round(1 - lora["first_step_peak_bytes"] / full["first_step_peak_bytes"], 3),
                      "saving_over_runtime": round(1 - (lora["step_peak_bytes"] - lora["runtime_bytes"])
                                                   / (full["step_peak_bytes"] - full["runtime_bytes"]), 3)}))

if __name__ == "__main__":
    main()
