"""Exact contexts (issue 40): trajectories that merge, and what the token path costs the gateway, before/after.

Three parts, each with exact contexts off (the text path, as before) and on,
in one run; prints one JSON line.

1. ``recipe``: the default recipe (``examples/guess_number/recipe.yaml``),
   its first ``--steps`` steps, trained twice with ``agl train``
   (``rollout.gateway.exact_contexts=false|true``). Per step: rollouts that
   did not merge into one row (``training/n_unmerged_rollouts``), rows and
   row tokens (prompt + response, what the trainer processes) per rollout,
   calls sent as text though they continued a conversation
   (``rollout/n_context_rebuilt``), the largest gap between the served and
   the trained log-prob of a sampled token, and the step time.
2. ``held_back_agent``: an agent the default recipe does not train, the tool
   game (``examples/guess_number/recipe_tools.yaml``: streamed tool calls,
   its history re-sent verbatim), ``--tool-steps`` steps at ``rollout.n=8``:
   unmerged rollouts off and on (goal: 0 on).
3. ``overhead``: one agent plays ``--conversations`` conversations of
   ``--turns`` turns through two gateways over one test endpoint, exact
   contexts off and on (a byte-level BPE tokenizer with a ChatML template,
   made here), interleaved conversation by conversation; per-call latency
   percentiles of the later turns (those that take the token path when on)
   and their difference (goal: at most 0.2 ms p50 more). Endpoint and
   gateways run in processes of their own, as in bench_gateway.py.

    python benchmarks/bench_contexts.py [--steps 10] [--tool-steps 3] [--conversations 300] [--turns 4]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SYSTEM = "You are a helpful assistant who answers questions about the world in a few words."


# ------------------------------------------------------------ 1 and 2: training runs


def train(recipe: str, steps: int, exact: bool, run_dir: Path, *overrides: str) -> list[dict]:
    """The metrics of each step of ``agl train recipe`` for ``steps`` steps (no validation, no checkpoint)."""
    command = [sys.executable, "-m", "agl_core.cli", "train", recipe, f"trainer.total_steps={steps}",
               "trainer.test_freq=0", "trainer.save_freq=0", "trainer.progress=false", f"trainer.run_dir={run_dir}",
               f"rollout.gateway.exact_contexts={str(exact).lower()}", *overrides]
    subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if "training/n_unmerged_rollouts" in m]


def summary(steps: list[dict]) -> dict:
    def per_rollout(key: str) -> float:
        return float(np.mean([m[key] / m["training/n_rollouts"] for m in steps]))

    return {"unmerged_per_step": [int(m["training/n_unmerged_rollouts"]) for m in steps],
            "rebuilt_calls_per_step": [int(m.get("rollout/n_context_rebuilt", 0)) for m in steps],
            "rows_per_rollout": round(per_rollout("training/n_triplets"), 3),
            "row_tokens_per_rollout": round(per_rollout("perf/total_num_tokens"), 2),
            "logprob_gap_max": max(m.get("training/rollout_logprob_diff/max", float("nan")) for m in steps),
            "step_s_mean": round(float(np.mean([m["timing_s/step"] for m in steps])), 3)}


def training_parts(args: argparse.Namespace, tmp: Path) -> dict:
    recipe, tools = "examples/guess_number/recipe.yaml", "examples/guess_number/recipe_tools.yaml"
    out: dict = {"recipe": {}, "held_back_agent": {}}
    for exact in (False, True):
        mode = "exact" if exact else "text"
        out["recipe"][mode] = summary(train(recipe, args.steps, exact, tmp / f"recipe_{mode}"))
        out["held_back_agent"][mode] = summary(train(tools, args.tool_steps, exact, tmp / f"tools_{mode}",
                                                     "rollout.n=8", "algorithm.ppo_mini_batch_size=8"))
    return out


# ------------------------------------------------------------ 3: the gateway's cost per call


def make_tokenizer(directory: Path) -> None:
    """A byte-level BPE tokenizer (2,000 tokens, trained on a few sentences) with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    text = [SYSTEM, "What is the capital of France?", "echo: the answer is Paris", "Tell me more about it."] * 50
    core.train_from_iterator(text, trainers.BpeTrainer(vocab_size=2000, special_tokens=["<|im_start|>", "<|im_end|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>",
                                        additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(directory)


def serve_gateway(upstream: str, n_rollouts: int, tokenizer: str) -> None:
    """Child process: a gateway (exact contexts on when ``tokenizer`` is set) over a memory store; prints the JSON
    list of its running attempts' base URLs (they carry each attempt's lease token)."""
    from agl_core.builtin.memory_store import MemoryStore
    from agl_core.config import GatewayConfig
    from agl_core.data import Task
    from agl_core.gateway import Gateway
    from agl_core.rollout.store import NewRollout

    store = MemoryStore()
    store.enqueue([NewRollout(f"r{i}", Task(id="t", input={})) for i in range(n_rollouts)])
    attempts = [store.dequeue("bench", lease_s=3600) for _ in range(n_rollouts)]
    config = GatewayConfig(exact_contexts=bool(tokenizer), tokenizer=tokenizer or None)
    server = Gateway(store, config, sampling={"temperature": 1.0, "max_tokens": 16}, upstreams=[upstream]).serve()
    gc.collect()
    gc.freeze()
    print(json.dumps([Gateway.base_url(server.url, a.rollout_id, a.attempt_id, a.lease) for a in attempts]),
          flush=True)
    sys.stdin.read()
    contexts = [s.attributes.get("context") for e in store._entries.values() for s in e.spans]
    print(json.dumps({"exact": contexts.count("exact"), "rebuilt": contexts.count("rebuilt")}), flush=True)
    server.stop()


async def conversation(session, base: str, turns: int, later: list[float]) -> None:
    """One agent's conversation: each turn re-sends the history, the model's replies verbatim, and a question."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}]
    for turn in range(turns):
        start = time.perf_counter()
        async with session.post(f"{base}/chat/completions", json={"model": "m", "messages": messages}) as response:
            answer = await response.json()
            if response.status != 200:
                raise RuntimeError(f"{base} answered {response.status}: {answer}")
        if turn:
            later.append(time.perf_counter() - start)
        messages += [{"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "Tell me more about it."}]


async def overhead_phase(urls: dict[str, list[str]], conversations: int, turns: int) -> dict[str, list[float]]:
    import aiohttp

    later: dict[str, list[float]] = {name: [] for name in urls}
    async with aiohttp.ClientSession() as session:
        for i in range(conversations):
            for name in (list(urls) if i % 2 else list(reversed(urls))):  # each mode first every other time
                await conversation(session, urls[name][i], turns,
                                   later[name] if i >= 10 else [])  # the first 10: warm-up
    return later


def start_child(*command: str) -> tuple[subprocess.Popen, str]:
    child = subprocess.Popen([sys.executable, *command], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    return child, child.stdout.readline().strip()


def overhead_part(args: argparse.Namespace, tmp: Path) -> dict:
    make_tokenizer(tmp / "tokenizer")
    endpoint, upstream = start_child("-m", "agl_core.testing.endpoint", "--port", "0")
    children, urls = [], {}
    try:
        for name, tokenizer in (("text", ""), ("exact", str(tmp / "tokenizer"))):
            child, url = start_child(__file__, "--serve-gateway", f"{upstream}/v1", str(args.conversations),
                                     tokenizer)
            children.append(child)
            urls[name] = json.loads(url)
        later = asyncio.run(overhead_phase(urls, args.conversations, args.turns))
        counts = {}
        for name, child in zip(urls, children):
            child.stdin.close()
            counts[name] = json.loads(child.stdout.readline())
            child.wait(30)
    finally:
        for child in children:
            child.kill()
        endpoint.kill()
    p50 = {name: float(np.percentile(values, 50)) * 1000 for name, values in later.items()}
    return {"calls_per_mode": len(later["text"]),
            **{f"{name}_ms": {"p50": round(p50[name], 3),
                              "p90": round(float(np.percentile(later[name], 90)) * 1000, 3)} for name in later},
            "exact_minus_text_p50_ms": round(p50["exact"] - p50["text"], 3), "goal_ms": 0.2,
            "spans": counts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tool-steps", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=300)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--skip-training", action="store_true", help="only the overhead part")
    parser.add_argument("--serve-gateway", nargs=3, metavar=("UPSTREAM", "N_ROLLOUTS", "TOKENIZER"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_gateway:
        upstream, n, tokenizer = args.serve_gateway
        serve_gateway(upstream, int(n), tokenizer)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = {"overhead": overhead_part(args, Path(tmp))}
        if not args.skip_training:
            out.update(training_parts(args, Path(tmp)))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
