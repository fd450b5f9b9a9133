#!/usr/bin/env python
"""Write a tiny randomly initialised causal LM and its word tokenizer to a directory: a smoke test's model.

    python scripts/make_smoke_model.py DIR [--architecture llama|qwen2] [--hidden-size 64] [--layers 2]

The vocabulary is examples/smoke's (the words its agent and prompts use). No hub is reached. The default
architecture is ``llama``: a Qwen2-shaped model (grouped-query attention, RoPE, SwiGLU, tied embeddings)
whose tokenizer ``AutoTokenizer`` loads as written (transformers 5 swaps the tokenizer of any ``qwen2`` model
for Qwen2's byte-level one, which vLLM and verl would then use); ``qwen2`` for a loader that takes the
tokenizer as it is (the embedded backend).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "plugins" / "agl-plugin-torch"))  # the checkout's, installed or not

VOCABULARY = ["yes", "no", "say", "maybe"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--architecture", choices=["llama", "qwen2"], default="llama")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from agl_plugin_torch import modeling
    from agl_plugin_torch.settings import BuildConfig, ModelConfig

    build = BuildConfig(architecture=args.architecture, vocabulary=VOCABULARY, hidden_size=args.hidden_size,
                        num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
                        max_position_embeddings=512)
    print(modeling.create(ModelConfig(build=build), args.out, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
