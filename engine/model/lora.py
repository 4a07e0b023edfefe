"""Batched LoRA: requests for different adapters and for the base model in one forward.

With ``--enable-lora`` every projection an adapter may target (``planner/lora_bytes.py``)
of every layer is wrapped in a ``LoraLinear`` holding preallocated A and B stacks of
``max_loras`` slots at ``max_lora_rank`` (as vLLM preallocates; the planner counts
exactly these bytes). An adapter is copied into a free slot when a batch needs it and
stays there until its slot is wanted by another. Each step, ``LoraSlots.batch`` builds
one bool ``[rows, max_loras * max_lora_rank]`` that is true on the rank columns of a row's
slot (nowhere for a base row), and each row's scaling; each wrapped layer then computes
``h = x A_all^T`` over all slots at once (``A_all``, ``B_all``: the stacks viewed as one
``max_loras * max_lora_rank`` matrix), *selects* each row's own columns of ``h`` with
``where`` (never a multiplication by a 0/1 mask: ``NaN x 0`` is NaN, so an adapter whose
product overflows would reach every row), and adds ``scaling * h B_all``. The other
slots' columns of a row are then exact zeros, and the B stacks hold finite values only
(an adapter is refused at load otherwise, and a slot is filled with its finite values
alone), so they add exact zeros: a row's delta is its own adapter's, and a base row's is
zero. Two products per layer however the rows mix adapters, as few operations as the
masked form. (Grouping rows by slot instead takes an ``index_select`` and an
``index_add_`` per slot per layer: many more operations per step, which is what costs on
a busy CPU; so does a ``where`` of each slot's delta over the full output.)
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
    """One step's rows by adapter slot: ``columns [rows, max_loras * max_lora_rank]`` is
    true on the rank columns of a row's slot (nowhere for a base row), ``scale [rows, 1]``
    its adapter's scaling (0 for a base row)."""

    columns: torch.Tensor
    scale: torch.Tensor


class LoraLinear(nn.Module):
    """A base linear layer plus the LoRA deltas of the rows that carry an adapter."""

    def __init__(self, base: nn.Module, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
        super().__init__()
        self.base = base
        # Plain attributes, not buffers: the slots are their own memory class in the plan,
        # not weights (engine/model/loader.py's weights_bytes counts buffers).
        self.lora_a = lora_a  # [max_loras, max_lora_rank, in]: each slot's A
        self.lora_b = lora_b  # [max_loras, max_lora_rank, out]: each slot's B, transposed
        slots, rank = lora_a.shape[:2]
        self._a_all = lora_a.view(slots * rank, -1)
        self._b_all = lora_b.view(slots * rank, -1)

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        out = self.base(x)
        if lora is None:
            return out
        hidden = torch.where(lora.columns, x @ self._a_all.T, 0.0)  # selected, not masked
        # PEFT's order: the delta times the scaling, then added.
        return out.addcmul_(hidden @ self._b_all, lora.scale)


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
        shapes = module_shapes(config.hidden_size, config.num_attention_heads, config.num_kv_heads,
                               config.head_dim, config.intermediate_size)
        self.modules: dict[tuple[int, str], LoraLinear] = {}
        for index, layer in enumerate(model.model.layers):
            for name, block_name in LORA_TARGETS.items():
                block = getattr(layer, block_name)
                fan_in, fan_out = shapes[name]
                a = torch.zeros(max_loras, max_lora_rank, fan_in, dtype=dtype, device=device)
                b = torch.zeros(max_loras, max_lora_rank, fan_out, dtype=dtype, device=device)
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
        runs = list(runs)
        # By id(adapter): an adapter read again from disk is another, in a slot of its own.
        adapters = {id(a): a for a, _ in runs if a is not None}
        if not adapters:
            return None
        if len(adapters) > self.max_loras:
            raise RuntimeError(f"{len(adapters)} adapters in one batch; --max-loras is "
                               f"{self.max_loras}")
        slots = self._place(adapters)
        rank = self.max_lora_rank
        slot_of_row, scale_of_row = [], []
        for adapter, count in runs:
            slot = -1 if adapter is None else slots[id(adapter)]
            slot_of_row += [slot] * count
            scale_of_row += [0.0 if adapter is None else adapter.scaling] * count
        row_slot = torch.tensor(slot_of_row, device=self.device)
        column_slot = torch.arange(self.max_loras * rank, device=self.device) // rank
        columns = row_slot[:, None] == column_slot[None, :]
        scale = torch.tensor(scale_of_row, dtype=self.dtype, device=self.device)[:, None]
        return LoraBatch(columns, scale)

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
        """Copy the adapter into ``slot``; zeros where it has no weights (a module it does
        not target, ranks past its own), so those columns add nothing."""
        self._held[slot] = adapter  # keeps id(adapter) its own while it holds the slot
        for key, module in self.modules.items():
            module.lora_a[slot].zero_()
            module.lora_b[slot].zero_()
            weights = adapter.weights.get(key)
            if weights is not None:
                a, b = weights
                module.lora_a[slot, :a.shape[0]].copy_(a)
                module.lora_b[slot, :a.shape[0]].copy_(b.T)
        # B must be finite for the other slots' zero columns to add exact zeros (module
        # docstring): the loader refused anything else; a fault since is zeroed here.
        for module in self.modules.values():
            torch.nan_to_num_(module.lora_b[slot], nan=0.0, posinf=0.0, neginf=0.0)
