"""Batched LoRA: requests for different adapters and for the base model in one forward.

With ``--enable-lora`` every projection an adapter may target (``planner/lora_bytes.py``)
of every layer is wrapped in a ``LoraLinear`` holding preallocated A and B stacks of
``max_loras`` slots at ``max_lora_rank`` (as vLLM preallocates; the planner counts
exactly these bytes). An adapter is copied into a free slot when a batch needs it and
stays there until its slot is wanted by another. Each step, ``LoraSlots.batch`` groups the
batch's rows by slot; each wrapped layer adds ``scaling * (x A^T) B^T`` to the rows of
each group (a gather, two small matmuls and an ``index_add_``), so base rows are the base
layer's output, untouched.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from kvledger.engine.model.lora_adapter import LoraAdapter
from kvledger.engine.planner.lora_bytes import LORA_TARGETS, module_shapes


@dataclass
class LoraBatch:
    """One step's rows by adapter slot: ``(slot, row indices)`` for every slot in use."""

    groups: list[tuple[int, torch.Tensor]]


class LoraLinear(nn.Module):
    """A base linear layer plus the LoRA deltas of the rows that carry an adapter."""

    def __init__(self, base: nn.Module, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
        super().__init__()
        self.base = base
        # Plain attributes, not buffers: the slots are their own memory class in the plan,
        # not weights (engine/model/loader.py's weights_bytes counts buffers).
        self.lora_a = lora_a  # [max_loras, max_lora_rank, in]
        self.lora_b = lora_b  # [max_loras, out, max_lora_rank]
        slots = lora_a.shape[0]
        self.ranks = [0] * slots       # the rank held in each slot; 0: no delta here
        self.scalings = [0.0] * slots

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        out = self.base(x)
        if lora is None:
            return out
        for slot, rows in lora.groups:
            rank = self.ranks[slot]
            if rank == 0:
                continue
            hidden = x.index_select(0, rows) @ self.lora_a[slot, :rank].T
            delta = hidden @ self.lora_b[slot, :, :rank].T
            out.index_add_(0, rows, delta * self.scalings[slot])
        return out


def project(linear: nn.Module, x: torch.Tensor, lora: LoraBatch | None) -> torch.Tensor:
    """``linear(x)``, with the step's LoRA rows when there are any (then ``linear`` is a
    ``LoraLinear``)."""
    return linear(x) if lora is None else linear(x, lora)


class LoraSlots:
    """The adapter slots of a model: which adapter each holds, and its weights there."""

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        config = model.config
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.device, self.dtype = device, dtype
        shapes = module_shapes(config.hidden_size, config.num_heads, config.num_kv_heads,
                               config.head_dim, config.intermediate_size)
        self.modules: dict[tuple[int, str], LoraLinear] = {}
        for index, layer in enumerate(model.model.layers):
            for name, block_name in LORA_TARGETS.items():
                block = getattr(layer, block_name)
                fan_in, fan_out = shapes[name]
                a = torch.zeros(max_loras, max_lora_rank, fan_in, dtype=dtype, device=device)
                b = torch.zeros(max_loras, fan_out, max_lora_rank, dtype=dtype, device=device)
                wrapped = LoraLinear(getattr(block, name), a, b)
                setattr(block, name, wrapped)
                self.modules[index, name] = wrapped
        # id(adapter) -> slot, least recently used first; the adapter each slot holds.
        self._slot_of: OrderedDict[int, int] = OrderedDict()
        self._held: list[LoraAdapter | None] = [None] * max_loras

    @property
    def bytes(self) -> int:
        """Device bytes of every A and B stack (what the plan's ``lora`` class counts)."""
        return sum(t.numel() * t.element_size() for m in self.modules.values()
                   for t in (m.lora_a, m.lora_b))

    def batch(self, runs: Iterable[tuple[LoraAdapter | None, int]]) -> LoraBatch | None:
        """The step's ``LoraBatch`` from its rows in order, as ``(adapter or None, number
        of rows)`` runs; None when no row has an adapter. The scheduler lets at most
        ``max_loras`` adapters into a batch; each is put in a slot here if not yet in one."""
        rows: dict[int, list[int]] = {}  # by id(adapter): a reloaded adapter is another
        adapters: dict[int, LoraAdapter] = {}
        at = 0
        for adapter, count in runs:
            if adapter is not None:
                rows.setdefault(id(adapter), []).extend(range(at, at + count))
                adapters[id(adapter)] = adapter
            at += count
        if not rows:
            return None
        if len(rows) > self.max_loras:
            raise RuntimeError(f"{len(rows)} adapters in one batch; --max-loras is "
                               f"{self.max_loras}")
        slots = self._place(adapters)
        return LoraBatch([(slots[key], torch.tensor(r, dtype=torch.long, device=self.device))
                          for key, r in rows.items()])

    def _place(self, adapters: dict[int, LoraAdapter]) -> dict[int, int]:
        """Each adapter's slot, loading those not in one into a free slot or the least
        recently used one that this batch does not need."""
        for key in adapters:
            if key in self._slot_of:
                self._slot_of.move_to_end(key)
        for key, adapter in adapters.items():
            if key in self._slot_of:
                continue
            taken = set(self._slot_of.values())
            free = [s for s in range(self.max_loras) if s not in taken]
            slot = free[0] if free else self._slot_of.pop(
                next(k for k in self._slot_of if k not in adapters))
            self._load(slot, adapter)
            self._slot_of[key] = slot
        return {key: self._slot_of[key] for key in adapters}

    def _load(self, slot: int, adapter: LoraAdapter) -> None:
        self._held[slot] = adapter  # keeps id(adapter) its own while it holds the slot
        for key, module in self.modules.items():
            weights = adapter.weights.get(key)
            if weights is None:
                module.ranks[slot], module.scalings[slot] = 0, 0.0
                continue
            a, b = weights
            rank = a.shape[0]
            module.lora_a[slot, :rank].copy_(a)
            module.lora_b[slot, :, :rank].copy_(b)
            module.ranks[slot], module.scalings[slot] = rank, adapter.scaling
