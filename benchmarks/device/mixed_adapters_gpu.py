"""Mixed-adapter generation vs one adapter on a GPU, with torch, transformers and peft only (no agl_core).

The device machine has no pydantic or omegaconf, so this measures the
mechanism the embedded endpoint uses (the batched per-row LoRA kernel of
``agl_plugin_torch/per_row_lora.py``, loaded by its path: it needs torch and
peft only) on a llama built from a config: tokens/s of one batch whose rows
use 4 adapters vs the same batch on one adapter (``mixed_vs_single``), peft's
own per-row ``adapter_names`` batch beside it (``peft_mixed_vs_single``), and
peak GPU memory with 4 adapters vs the base. One JSON line per model size.

    python benchmarks/device/mixed_adapters_gpu.py
"""

import importlib.util
import json
import sys
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM


KERNEL = Path(__file__).resolve().parents[2] / "plugins/agl-plugin-torch/agl_plugin_torch/per_row_lora.py"


def load_kernel():
    spec = importlib.util.spec_from_file_location("per_row_lora", KERNEL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def run(hidden, layers, rows=64, new=64, rank=16):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                         num_attention_heads=hidden // 128, num_key_value_heads=hidden // 128,
                         max_position_embeddings=512)
    torch.cuda.reset_peak_memory_stats()
    base = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    prompts = torch.randint(10, 32000, (rows, 32), device="cuda")
    base.generate(prompts, max_new_tokens=4, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    base_peak = torch.cuda.max_memory_allocated()
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear")
    model = get_peft_model(base, lora, adapter_name="a0")
    for name in ("a1", "a2", "a3"):
        model.add_adapter(name, lora)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".a0." in n)
    model.eval()
    kernel = load_kernel()
    kernel.pack_adapters(model)
    names = [f"a{i % 4}" for i in range(rows)]

    def gen(per_row=None, **kw):
        if per_row is not None:
            with kernel.rows_through_adapters(model, per_row, "__base__"):
                return gen(**kw)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(input_ids=prompts, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=0, **kw)
        torch.cuda.synchronize()
        return (out.shape[1] - prompts.shape[1]) * rows / (time.perf_counter() - t)

    with torch.no_grad():  # the kernel's logits against peft's own mixed batch, in this dtype on this device
        reference = model(input_ids=prompts, adapter_names=names).logits.float()
        with kernel.rows_through_adapters(model, names, "__base__"):
            kernel_diff = (model(input_ids=prompts).logits.float() - reference).abs().max().item()
    gen(per_row=names)
    gen(adapter_names=names)
    gen()
    torch.cuda.reset_peak_memory_stats()
    mixed = max(gen(per_row=names) for _ in range(3))
    multi_peak = torch.cuda.max_memory_allocated()
    peft_mixed = max(gen(adapter_names=names) for _ in range(3))
    single = max(gen() for _ in range(3))
    grouped_t = 0.0
    for name in ("a0", "a1", "a2", "a3"):
        model.set_adapter(name)
        sub = prompts[: rows // 4]
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(input_ids=sub, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        grouped_t += time.perf_counter() - t
    grouped = rows * new / grouped_t
    print(json.dumps({"hidden": hidden, "layers": layers, "rows": rows, "new_tokens": new, "rank": rank,
                      "dtype": "bfloat16", "max_abs_logit_diff_vs_peft": kernel_diff, "mixed_tokens_per_s": mixed,
                      "single_tokens_per_s": single,
                      "peft_mixed_tokens_per_s": peft_mixed, "grouped_tokens_per_s": grouped,
                      "mixed_vs_single": mixed / single, "peft_mixed_vs_single": peft_mixed / single,
                      "grouped_vs_single": grouped / single, "base_peak_bytes": base_peak,
                      "four_adapters_peak_bytes": multi_peak, "one_adapter_bytes": adapter_bytes,
                      "within_bound": multi_peak <= (base_peak + 4 * adapter_bytes) * 1.10}), flush=True)
    del model, base
    torch.cuda.empty_cache()


if __name__ == "__main__":
    for hidden, layers in ((1024, 8), (2048, 16)):
        run(hidden, layers)
