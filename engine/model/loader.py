"""Load a checkpoint's safetensors (single file or sharded with an index) into CausalLM."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch

from kvledger.engine.errors import BadInput
from kvledger.engine.model.config import ModelConfig
from kvledger.engine.model.loadable import IGNORED_SUFFIXES, loaded_names
from kvledger.engine.model.transformer import CausalLM


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
                    if not name.endswith(IGNORED_SUFFIXES):
                        state[name] = f.get_tensor(name).to(device=device, dtype=dtype)
        except (OSError, RuntimeError) as exc:
            raise BadInput(f"{path}: cannot read safetensors: {exc}") from None
    if config.moe is not None:
        state = _split_fused_experts(state, config)
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


def _split_fused_experts(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Published MoE checkpoints name each expert's tensors (``experts.{i}.gate_proj``;
    Mixtral's ``block_sparse_moe.experts.{i}.w1``); transformers 5 saves them fused when
    asked to (``save_original_format=False``), the router as ``mlp.gate.weight``. Split
    those into per-expert views (no copy), named as ``loaded_names`` says, which is also
    what the pre-flight checks the headers against."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        names = loaded_names(name, tuple(tensor.shape), config)
        if len(names) == 1:
            out[names[0]] = tensor
        elif name.endswith("down_proj"):  # [experts, hidden, inter]: each expert's down
            out.update(zip(names, tensor.unbind(0), strict=True))
        else:  # gate_up_proj, [experts, 2 * inter, hidden]: each expert's gate, then up
            halves = (half for matrix in tensor for half in matrix.chunk(2))
            out.update(zip(names, halves, strict=True))
    return out


def weights_bytes(model: CausalLM) -> int:
    """Bytes of the resident weights (parameters, and the packed weights the CPU's
    linear layers hold as buffers), a tied tensor counted once."""
    seen: set[int] = set()
    total = 0
    for t in itertools.chain(model.parameters(), model.buffers()):
        key = id(t) if t.is_mkldnn else t.data_ptr()  # an opaque oneDNN tensor has no pointer
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total
