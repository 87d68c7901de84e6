"""Per-rank bytes of a LoRA fine-tune of a Llama-2-7B-shaped model (rank 16 on q/k/v/o, base frozen), stages 2 and 3:
estimate_memory on a meta-device build (tests/test_frozen_sharded.py checks the estimate against memory_report()
byte for byte). Prints a Markdown table; no memory is allocated."""
from __future__ import annotations

import sys

import torch
from torch import nn

try:
    import transformers
except ImportError:
    sys.exit("bench/lora_memory.py builds a Hugging Face Llama on the meta device: pip install transformers")
import zerocore


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, r: int = 16) -> None:
        super().__init__()
        self.base = base
        self.a = nn.Linear(base.in_features, r, bias=False)
        self.b = nn.Linear(r, base.out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.b(self.a(x))


with torch.device("meta"):
    cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                                   num_key_value_heads=32, vocab_size=32000)
    model = transformers.LlamaForCausalLM(cfg)
    model.requires_grad_(False)
    for layer in model.model.layers:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(layer.self_attn, name, LoRALinear(getattr(layer.self_attn, name)))
print("| stage | world | frozen_params GiB/rank | trainable state GiB/rank | total GiB/rank |")
print("|---|---:|---:|---:|---:|")
for world in (8, 64):
    for stage in (2, 3):
        r = zerocore.estimate_memory(model, {"bf16": {"enabled": True}, "zero_optimization": {"stage": stage}}, world, device="cuda")
        b = r["bytes"]
        state = b["params"] + b["grads"] + b["master_params"] + b["optimizer_moments"]
        print(f"| {stage} | {world} | {b['frozen_params']/2**30:.2f} | {state/2**30:.3f} | {r['total_bytes']/2**30:.2f} |")
