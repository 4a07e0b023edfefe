"""Load a checkpoint's safetensors (single file or sharded with an index) into CausalLM."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvledger.engine.errors import BadInput
from kvledger.engine.model import CausalLM
from kvledger.engine.model_config import ModelConfig

# Buffers some older checkpoints carry that the engine recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise BadInput(f"{index}: bad safetensors index: {exc}") from None
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise BadInput(f"{model_dir}: no *.safetensors weights (pytorch .bin is not supported)")
    return shards


def load_model(model_dir: str | Path, config: ModelConfig, dtype: torch.dtype,
               device: torch.device) -> CausalLM:
    """Build the model on the meta device, then assign the checkpoint's tensors in ``dtype``
    on ``device``: no random init, no second copy of the weights."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    with torch.device("meta"):
        model = CausalLM(config)
    state: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(model_dir):
        if not path.is_file():
            raise BadInput(f"{path}: listed in the index but missing")
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    if not name.endswith(_IGNORED_SUFFIXES):
                        state[name] = f.get_tensor(name).to(device=device, dtype=dtype)
        except (OSError, RuntimeError) as exc:
            raise BadInput(f"{path}: cannot read safetensors: {exc}") from None
    if "lm_head.weight" not in state and config.tie_word_embeddings:
        state["lm_head.weight"] = state.get("model.embed_tokens.weight")
    shapes = {name: t.shape for name, t in model.state_dict().items()}
    expected = set(shapes)
    missing = sorted(expected - {k for k, v in state.items() if v is not None})
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        detail = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise BadInput(f"{model_dir}: checkpoint does not match {config.architecture}: {detail}")
    for name, tensor in state.items():
        want = shapes[name]
        if tensor.shape != want:
            raise BadInput(f"{model_dir}: {name} has shape {tuple(tensor.shape)}, config says {tuple(want)}")
    model.load_state_dict(state, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval().requires_grad_(False)


def weights_bytes(model: CausalLM) -> int:
    """Bytes of the resident parameters, a tied tensor counted once."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total
