"""Read a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``) and
check it fits the base model and the limits, refusing by name what the engine would run
wrong: a rank over ``--max-lora-rank``, a module it cannot adapt, a tensor whose shape is
not the base layer's, PEFT options that change the maths (DoRA, biases, patterns).

The scaling is PEFT's: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvledger.engine.errors import BadInput
from kvledger.engine.lora_config import LoRARequest
from kvledger.engine.model.config import ModelConfig
from kvledger.engine.planner.lora_bytes import LORA_TARGETS, module_shapes

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_DEFAULT_ALPHA = 8  # peft.LoraConfig's lora_alpha when the file has none
_TENSOR = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\."
                     r"(\w+)\.lora_([AB])\.weight$")


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
                 max_lora_rank: int) -> LoraAdapter:
    """The adapter in ``directory``; BadInput, one line naming the adapter and what is
    wrong, when it cannot run on this base model within ``max_lora_rank``."""
    from safetensors import SafetensorError, safe_open

    where = f"LoRA adapter {request.lora_name!r} ({request.lora_path})"
    directory = Path(directory)
    raw = _read_config(directory, where)
    rank, scaling, targets = _check_config(raw, where, max_lora_rank)
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        raise BadInput(f"{where}: no {WEIGHTS_FILE} (kvledger loads safetensors adapters)")
    shapes = module_shapes(config.hidden_size, config.num_heads, config.num_kv_heads,
                           config.head_dim, config.intermediate_size)
    halves: dict[tuple[int, str, str], torch.Tensor] = {}
    try:
        with safe_open(str(weights_path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                match = _TENSOR.match(name)
                if match is None or match[3] not in LORA_TARGETS \
                        or LORA_TARGETS[match[3]] != match[2]:
                    raise BadInput(f"{where}: tensor {name!r} adapts nothing kvledger can "
                                   f"adapt (the {', '.join(LORA_TARGETS)} projections)")
                layer, module = int(match[1]), match[3]
                if layer >= config.num_layers:
                    raise BadInput(f"{where}: {name!r} is for layer {layer}; the base model "
                                   f"has {config.num_layers}")
                halves[layer, module, match[4]] = f.get_tensor(name).to(torch.float32)
    except (OSError, SafetensorError) as exc:
        raise BadInput(f"{where}: cannot read {WEIGHTS_FILE}: {exc}") from None
    weights = {}
    for (layer, module, half), a in sorted(halves.items()):
        if half != "A":
            continue
        b = halves.get((layer, module, "B"))
        if b is None:
            raise BadInput(f"{where}: layer {layer} {module} has lora_A but no lora_B")
        fan_in, fan_out = shapes[module]
        if module not in targets:
            raise BadInput(f"{where}: layer {layer} {module} has weights but "
                           f"target_modules does not name it")
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise BadInput(f"{where}: layer {layer} {module} has lora_A {tuple(a.shape)} and "
                           f"lora_B {tuple(b.shape)}; rank {rank} on this base model needs "
                           f"{(rank, fan_in)} and {(fan_out, rank)}")
        weights[layer, module] = (a, b)
    orphans = sorted(k for k in halves if k[2] == "B" and (k[0], k[1]) not in weights)
    if orphans:
        raise BadInput(f"{where}: layer {orphans[0][0]} {orphans[0][1]} has lora_B but no lora_A")
    if not weights:
        raise BadInput(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    return LoraAdapter(request, str(directory), rank, scaling, weights)


def _read_config(directory: Path, where: str) -> dict:
    path = directory / CONFIG_FILE
    if not directory.is_dir():
        raise BadInput(f"{where}: no such directory")
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise BadInput(f"{where}: no {CONFIG_FILE} (not a PEFT adapter directory)") from None
    except (OSError, ValueError) as exc:
        raise BadInput(f"{where}: cannot read {CONFIG_FILE}: {exc}") from None
    if not isinstance(raw, dict):
        raise BadInput(f"{where}: {CONFIG_FILE} is not a JSON object")
    return raw


def _check_config(raw: dict, where: str, max_lora_rank: int) -> tuple[int, float, set[str]]:
    """``(rank, scaling, targeted modules)``, or BadInput naming what cannot run."""
    if raw.get("peft_type", "LORA") != "LORA":
        raise BadInput(f"{where}: peft_type {raw['peft_type']!r}; kvledger serves LORA adapters")
    rank = raw.get("r", 8)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise BadInput(f"{where}: r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise BadInput(f"{where}: rank {rank} is over --max-lora-rank {max_lora_rank}")
    alpha = raw.get("lora_alpha", PEFT_DEFAULT_ALPHA)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise BadInput(f"{where}: lora_alpha must be a number, got {alpha!r}")
    refused = [(raw.get("use_dora"), "use_dora (DoRA)"),
               (raw.get("bias", "none") != "none", f"bias {raw.get('bias')!r}"),
               (raw.get("modules_to_save"), "modules_to_save"),
               (raw.get("fan_in_fan_out"), "fan_in_fan_out"),
               (raw.get("rank_pattern"), "rank_pattern"),
               (raw.get("alpha_pattern"), "alpha_pattern")]
    for given, what in refused:
        if given:
            raise BadInput(f"{where}: kvledger does not serve adapters with {what}")
    targets = raw.get("target_modules")
    if targets == "all-linear":
        targets = list(LORA_TARGETS)
    if isinstance(targets, str) or not isinstance(targets, list) or not targets:
        raise BadInput(f"{where}: target_modules must be a list of module names or "
                       f"\"all-linear\", got {targets!r}")
    unknown = sorted(str(t) for t in targets if t not in LORA_TARGETS)
    if unknown:
        raise BadInput(f"{where}: target module {unknown[0]!r} is not one kvledger adapts "
                       f"({', '.join(LORA_TARGETS)})")
    scaling = alpha / (math.sqrt(rank) if raw.get("use_rslora") else rank)
    return rank, float(scaling), set(targets)
