"""A routed layer's activations, estimated (``estimates.mlp_bytes_per_token``) against the
bytes the engine's ``SparseMoE`` really holds at its peak, counted tensor by tensor on the
CPU (which keeps no allocator statistics), and what that changes in a published model's plan.
"""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch
from published_models import published_shape, published_weights
from torch.utils._python_dispatch import TorchDispatchMode

from kvledger.engine.checkpoint.moe_config import MoEConfig
from kvledger.engine.model.moe import MixtralExpert, SparseMoE
from kvledger.engine.model.transformer import MLP
from kvledger.engine.planner import estimates
from kvledger.engine.planner.device import DeviceMemory
from kvledger.engine.planner.plan import make_plan
from kvledger.engine.settings.config import EngineConfig

GiB = 2**30


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by tensors made inside it (each storage counted once,
    while any tensor made here still refers to it): what an allocator's peak would show
    above what existed before."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage address -> [bytes, tensors holding it]
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                self._hold(t)
        return out

    def _hold(self, t: torch.Tensor) -> None:
        key = t.untyped_storage().data_ptr()
        entry = self.live.get(key)
        if entry is None:
            entry = self.live[key] = [t.untyped_storage().nbytes(), 0]
            self.now += entry[0]
            self.peak = max(self.peak, self.now)
        entry[1] += 1
        weakref.finalize(t, self._drop, key)

    def _drop(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[key]


def _routed_peak(moe: MoEConfig, hidden: int, tokens: int, dtype: torch.dtype,
                 expert: type[torch.nn.Module]) -> int:
    """The peak bytes of one routed MLP's forward over ``tokens`` tokens, every token
    routed to expert 0 among its top k (the heaviest case: one expert takes them all)."""
    torch.manual_seed(0)
    layer = SparseMoE(hidden, moe, expert).to(dtype)
    with torch.no_grad():
        layer.gate.weight[0] = 0
        x = torch.rand(tokens, hidden, dtype=dtype) + 0.5
        layer.gate.weight[0, 0] = 100.0  # expert 0's logit dwarfs the others'
    with torch.inference_mode(), LiveBytes() as counted:
        out = layer(x)
    assert out.shape == x.shape
    return counted.peak


@pytest.mark.parametrize("dtype, expert, num_experts, top_k", [
    (torch.float32, MLP, 16, 4),              # Qwen3-MoE's expert (gate/up/down_proj)
    (torch.bfloat16, MLP, 128, 8),            # Qwen3-30B-A3B's routing
    (torch.bfloat16, MixtralExpert, 8, 2),    # Mixtral's
])
def test_routed_layer_estimate_holds_what_the_engine_holds(dtype, expert, num_experts,
                                                           top_k) -> None:
    hidden, width, tokens = 64, 48, 512
    moe = MoEConfig(num_experts, top_k, width, True, (0, 1))
    measured = _routed_peak(moe, hidden, tokens, dtype, expert)
    shape = dataclasses.replace(published_shape("Qwen3-30B-A3B"), num_layers=2,
                                hidden_size=hidden, intermediate_size=16 * width, moe=moe)
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    # The estimate's MLP term, plus the routed layer's own output (counted in the layer's
    # 4 * hidden outside the MLP term), is an upper bound that is not loose.
    estimated = tokens * (estimates.mlp_bytes_per_token(shape, dtype_bytes) + hidden * dtype_bytes)
    assert measured <= estimated <= 1.25 * measured, (measured, estimated)
    # The dense width no routed layer runs would have counted 16 experts' width.
    dense = tokens * 3 * shape.intermediate_size * dtype_bytes
    assert dense > 2 * estimated


def test_dense_layers_beside_routed_ones_count_the_wider_mlp() -> None:
    qwen = published_shape("Qwen3-30B-A3B")
    routed = estimates.mlp_bytes_per_token(qwen, 2)
    with_dense = dataclasses.replace(qwen, moe=dataclasses.replace(
        qwen.moe, sparse_layers=qwen.moe.sparse_layers[1:]))  # layer 0 dense (mlp_only_layers)
    assert estimates.mlp_bytes_per_token(with_dense, 2) == 3 * qwen.intermediate_size * 2 > routed
    assert estimates.mlp_bytes_per_token(dataclasses.replace(qwen, moe=None), 2) == \
        3 * qwen.intermediate_size * 2


def test_qwen3_30b_a3b_plans_its_experts_width_not_its_unused_dense_one() -> None:
    """Qwen3-30B-A3B routes every layer (48 of 48): its config's intermediate_size 6144 is
    no layer's, its experts are 768 wide. On an 80 GiB GPU at utilization 0.9 and 32,768
    batched tokens its activations were planned at 1.97 GiB; now 1.26 GiB, and the pool
    gets 481 blocks more."""
    shape = published_shape("Qwen3-30B-A3B")
    assert (shape.intermediate_size, shape.moe.intermediate_size,
            len(shape.moe.sparse_layers), shape.num_layers) == (6144, 768, 48, 48)
    device = DeviceMemory("what-if", "H100", 80 * GiB, 79 * GiB, False)

    def planned(s):
        config = EngineConfig(model="/unused", max_model_len=32768,
                              max_num_batched_tokens=32768, gpu_memory_utilization=0.9)
        return make_plan(config, device=device, shape=s,
                         weights=published_weights("Qwen3-30B-A3B"))
    now, dense = planned(shape), planned(dataclasses.replace(shape, moe=None))
    assert (round(dense.classes["activations"] / GiB, 2),
            round(now.classes["activations"] / GiB, 2)) == (1.97, 1.26)
    assert now.kv.num_blocks - dense.kv.num_blocks == 481
