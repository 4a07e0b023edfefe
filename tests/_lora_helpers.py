"""LoRA adapters the tests write (PEFT's layout: adapter_config.json +
adapter_model.safetensors, tensors named as ``PeftModel.save_pretrained`` names them), and
transformers + peft's greedy tokens with one, the reference for the engine's."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvledger.engine.planner.lora_bytes import LORA_TARGETS, module_shapes

ALL_TARGETS = tuple(LORA_TARGETS)


def write_adapter(out: Path, model_dir: Path, *, rank: int = 8, alpha: float = 16,
                  targets: tuple[str, ...] = ALL_TARGETS, seed: int = 0,
                  use_rslora: bool = False, scale: float = 0.2, **config) -> Path:
    """A PEFT adapter for the checkpoint in ``model_dir``: random A and B, B nonzero (as
    after training) so that the adapter changes the tokens."""
    from safetensors.torch import save_file

    base = json.loads((Path(model_dir) / "config.json").read_text())
    heads = base["num_attention_heads"]
    head_dim = base.get("head_dim") or base["hidden_size"] // heads
    shapes = module_shapes(base["hidden_size"], heads, base["num_key_value_heads"], head_dim,
                           base["intermediate_size"])
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(base["num_hidden_layers"]):
        for module in targets:
            fan_in, fan_out = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{LORA_TARGETS[module]}.{module}"
            tensors[prefix + ".lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * scale
            tensors[prefix + ".lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * scale
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
        "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none",
        "use_rslora": use_rslora, "base_model_name_or_path": str(model_dir), **config}))
    return out


def peft_greedy(model_dir: Path, adapter_dir: Path, prompt: list[int],
                max_new_tokens: int) -> list[int]:
    """transformers + peft's greedy tokens with the adapter (fp32, CPU)."""
    import transformers
    from peft import PeftModel

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([prompt]),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()
