"""Mixed-adapter generation vs one adapter on a GPU, with torch, transformers and peft only (no agl_core).

The device machine has no pydantic or omegaconf, so this measures the
mechanism the embedded endpoint uses (peft's per-row ``adapter_names``) on a
llama built from a config: tokens/s of one batch whose rows use 4 adapters
vs the same batch on one adapter, and peak GPU memory with 4 adapters vs the
base. One JSON line per model size.

    python benchmarks/device/mixed_adapters_gpu.py
"""

import json
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM


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
    names = [f"a{i % 4}" for i in range(rows)]

    def gen(**kw):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(input_ids=prompts, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=0, **kw)
        torch.cuda.synchronize()
        return (out.shape[1] - prompts.shape[1]) * rows / (time.perf_counter() - t)

    gen(adapter_names=names)
    gen()
    torch.cuda.reset_peak_memory_stats()
    mixed = max(gen(adapter_names=names) for _ in range(3))
    multi_peak = torch.cuda.max_memory_allocated()
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
                      "dtype": "bfloat16", "mixed_tokens_per_s": mixed, "single_tokens_per_s": single,
                      "grouped_tokens_per_s": grouped, "mixed_vs_single": mixed / single,
                      "grouped_vs_single": grouped / single, "base_peak_bytes": base_peak,
                      "four_adapters_peak_bytes": multi_peak, "one_adapter_bytes": adapter_bytes,
                      "within_bound": multi_peak <= (base_peak + 4 * adapter_bytes) * 1.10}), flush=True)
    del model, base
    torch.cuda.empty_cache()


if __name__ == "__main__":
    for hidden, layers in ((1024, 8), (2048, 16)):
        run(hidden, layers)
