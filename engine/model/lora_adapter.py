"""Load a PEFT LoRA adapter: its files checked as the pre-flight checks them
(``planner/adapters.py``: config and safetensors header, before any tensor data is read,
so a wrong file of any size costs a header), then its weights, refused by name when they
are not finite, in float32 or in the model's dtype."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvledger.engine.checkpoint.model_config import ModelConfig
from kvledger.engine.errors import BadInput
from kvledger.engine.planner.adapters import (  # noqa: F401 - re-exported
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterNotFound,
    max_weights_bytes,
    read_adapter_files,
)
from kvledger.engine.settings.lora_config import LoRARequest


@dataclass
class LoraAdapter:
    """An adapter loaded on the host: ``weights`` maps ``(layer, module)`` to ``(A, B)``
    (``A [r, in]``, ``B [out, r]``), in float32."""

    request: LoRARequest
    path: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def name(self) -> str:
        return self.request.lora_name

    @property
    def lora_int_id(self) -> int:
        return self.request.lora_int_id


def load_adapter(request: LoRARequest, directory: str | Path, config: ModelConfig,
                 max_lora_rank: int, dtype: torch.dtype = torch.float32) -> LoraAdapter:
    """The adapter in ``directory``; BadInput, one line naming the adapter and what is
    wrong, when it cannot run on this base model within ``max_lora_rank`` (its files, read
    by ``planner/adapters.py`` as the pre-flight reads them), or in ``dtype`` (the model's:
    every weight must be finite there too). Messages name the adapter, never its path on
    the server (they may reach a client)."""
    from safetensors import SafetensorError, safe_open

    where = f"LoRA adapter {request.lora_name!r}"
    files = read_adapter_files(where, directory, config, max_lora_rank)
    weights = {}
    try:
        with safe_open(str(files.weights_path), framework="pt", device="cpu") as f:
            for (layer, module), (a_name, b_name) in files.names.items():
                a, b = f.get_tensor(a_name), f.get_tensor(b_name)
                for half, tensor in (("lora_A", a), ("lora_B", b)):
                    if not torch.isfinite(tensor).all():
                        raise BadInput(f"{where}: layer {layer} {module} {half} holds values "
                                       "that are not finite (NaN or infinity)")
                    if not torch.isfinite(tensor.to(dtype)).all():
                        raise BadInput(f"{where}: layer {layer} {module} {half} holds values "
                                       f"beyond {dtype} (the model's dtype)")
                weights[layer, module] = (a.to(torch.float32), b.to(torch.float32))
    except (OSError, SafetensorError) as exc:
        raise BadInput(f"{where}: cannot read {WEIGHTS_FILE}: {exc}") from None
    return LoraAdapter(request, str(directory), files.rank, files.scaling, weights)
