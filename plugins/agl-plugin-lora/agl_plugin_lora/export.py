"""Export: a checkpoint's adapter merged into its base model, written as a plain Hugging Face model.

The embedded backend writes the adapted actor of a checkpoint as
``<checkpoint>/actor``: the adapter (``adapter_config.json``, whose
``base_model_name_or_path`` is the local base model) and the tokenizer.
Merging folds ``(alpha / rank) * B @ A`` into each adapted weight, so the
result loads with ``AutoModelForCausalLM.from_pretrained`` without peft.

Command line: ``agl-lora-merge RUN_DIR_OR_CHECKPOINT --merged OUT`` (what
``agl export RUN_DIR --merged OUT`` should call).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from peft import PeftModel
from transformers import AutoModelForCausalLM

from agl_core.checkpoint import latest_checkpoint

from agl_plugin_torch.backend import ACTOR_DIR

from agl_plugin_lora.adapter import ADAPTER_CONFIG

ADAPTER_FILES = (ADAPTER_CONFIG, "adapter_model.safetensors", "adapter_model.bin")


def adapter_dir(path: Path) -> Path:
    """The adapter directory of a run directory (its latest checkpoint), a checkpoint, or an adapter directory."""
    path = Path(path)
    if (path / ADAPTER_CONFIG).is_file():
        return path
    if (path / ACTOR_DIR / ADAPTER_CONFIG).is_file():
        return path / ACTOR_DIR
    checkpoint = latest_checkpoint(path)
    if checkpoint is not None and (checkpoint / ACTOR_DIR / ADAPTER_CONFIG).is_file():
        return checkpoint / ACTOR_DIR
    raise FileNotFoundError(f"no LoRA adapter at {path}: expected a run directory with checkpoints, a checkpoint "
                            f"directory, or a directory with {ADAPTER_CONFIG}")


def merge(path: Path, out: Path) -> Path:
    """Write the base model with the adapter of ``path`` merged in, and the tokenizer, to ``out``."""
    source = adapter_dir(path)
    base_path = json.loads((source / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]
    base = AutoModelForCausalLM.from_pretrained(base_path, local_files_only=True)
    merged = PeftModel.from_pretrained(base, source, local_files_only=True).merge_and_unload()
    out.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(out)
    # The tokenizer files are copied, not re-saved: a word tokenizer of a qwen2 model would be replaced by
    # Qwen2's if it went through AutoTokenizer.
    for file in source.iterdir():
        if file.is_file() and file.name not in ADAPTER_FILES and not (out / file.name).exists():
            shutil.copy2(file, out / file.name)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agl-lora-merge", description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="run directory (latest checkpoint), checkpoint, or adapter directory")
    parser.add_argument("--merged", type=Path, required=True, help="directory to write the merged model to")
    args = parser.parse_args(argv)
    print(merge(args.path, args.merged))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
