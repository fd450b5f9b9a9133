"""Export: a checkpoint's adapter, alone or merged into its base model as a plain Hugging Face model.

The embedded backend writes the adapted actor of a checkpoint as
``<checkpoint>/actor``: the adapter (``adapter_config.json``, whose
``base_model_name_or_path`` is the local base model) and the tokenizer.
Merging folds ``(alpha / rank) * B @ A`` into each adapted weight and puts the
trained copies of ``modules_to_save`` in place of the originals, so the
result loads with ``AutoModelForCausalLM.from_pretrained`` without peft.

Command line: ``agl export RUN_DIR --merged OUT`` (the core's command; this
plugin answers its ``export_model`` hook for checkpoints that hold an adapter).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from agl_plugin_lora.adapter import ADAPTER_CONFIG

ADAPTER_FILES = (ADAPTER_CONFIG, "adapter_model.safetensors", "adapter_model.bin")


def is_adapter_dir(path: Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def copy_adapter(adapter: Path, out: Path) -> Path:
    """The adapter directory (adapter, its config, the tokenizer) copied to ``out``."""
    _require_adapter(adapter)
    shutil.copytree(adapter, out, dirs_exist_ok=True)
    return out


def merge(adapter: Path, out: Path) -> Path:
    """Write the base model with the adapter of the directory ``adapter`` merged in, and the tokenizer, to ``out``."""
    adapter, out = Path(adapter), Path(out)
    _require_adapter(adapter)
    base_path = json.loads((adapter / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]
    base = AutoModelForCausalLM.from_pretrained(base_path, local_files_only=True)
    merged = PeftModel.from_pretrained(base, adapter, local_files_only=True).merge_and_unload()
    untie_if_trained_apart(merged)
    out.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(out)
    # The tokenizer files are copied, not re-saved: a word tokenizer of a qwen2 model would be replaced by
    # Qwen2's if it went through AutoTokenizer.
    for file in adapter.iterdir():
        if file.is_file() and file.name not in ADAPTER_FILES and not (out / file.name).exists():
            shutil.copy2(file, out / file.name)
    return out


def untie_if_trained_apart(model) -> None:
    """Record untied embeddings when the input embedding and the output head no longer hold the same weights.

    With tied embeddings, a trained copy of ``embed_tokens`` or ``lm_head``
    (``modules_to_save``) leaves the other one as it was: saved as tied, the
    merged model would read one matrix for both and compute something else.
    """
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if not getattr(model.config, "tie_word_embeddings", False) or outputs is None:
        return
    if inputs.weight is outputs.weight or torch.equal(inputs.weight, outputs.weight):
        return
    outputs.weight = torch.nn.Parameter(outputs.weight.detach().clone())
    model.config.tie_word_embeddings = False
    text_config = getattr(model.config, "get_text_config", lambda: None)()
    if text_config is not None:
        text_config.tie_word_embeddings = False


def export_policies(policies_dir: Path, out: Path, merged: bool, policy: str | None) -> Path:
    """A checkpoint of several policies: ``policy``'s adapter merged or alone, else every adapter in ``out/<name>``."""
    written = sorted(p.name for p in policies_dir.iterdir() if is_adapter_dir(p))
    if policy is None:
        if merged:
            raise ValueError(f"the checkpoint holds the adapters of {', '.join(written)}: name one with --policy")
        for name in written:
            copy_adapter(policies_dir / name, out / name)
        return out
    if policy not in written:
        raise ValueError(f"policy {policy!r} has no adapter in {policies_dir} (adapters: {', '.join(written)}; "
                         f"a base policy is the base model itself)")
    return (merge if merged else copy_adapter)(policies_dir / policy, out)


def _require_adapter(path: Path) -> None:
    if not is_adapter_dir(path):
        raise FileNotFoundError(f"no LoRA adapter at {path}: expected a directory with {ADAPTER_CONFIG}")
