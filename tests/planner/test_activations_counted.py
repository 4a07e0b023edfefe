"""The planner's activation class against the bytes the engine's own steps hold at their
peak, counted tensor by tensor on the CPU (which keeps no allocator statistics; on a GPU the
engine measures its profile and ``bench/gpu_memory_check.py`` holds it to the plan): the
heaviest steps of every built-in model, and a routed layer
(``estimates.mlp_bytes_per_token``), with what that changes in a published model's plan.
Kernels' internal workspaces (oneDNN's, SDPA's) are not tensors and are not counted.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _live_bytes import LiveBytes
from published_models import published_shape, published_weights

from kvledger.engine.checkpoint.model_config import ModelConfig
from kvledger.engine.checkpoint.moe_config import MoEConfig
from kvledger.engine.core.runner import ModelRunner
from kvledger.engine.model.moe import MixtralExpert, SparseMoE
from kvledger.engine.model.transformer import MLP, CausalLM
from kvledger.engine.planner import estimates
from kvledger.engine.planner.device import DeviceMemory
from kvledger.engine.planner.plan import make_plan
from kvledger.engine.planner.pool import blocks_for
from kvledger.engine.settings.config import EngineConfig

GiB = 2**30
BUILT_IN = ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-mixtral",
            "tiny-qwen3-moe"]


@pytest.mark.parametrize("name", BUILT_IN)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engines_heaviest_steps_hold_no_more_than_the_plan(make_model_dir, name, dtype):
    """The start-up profile's two steps (whole prompts with their logits and a slice of
    prompt logprobs; decodes at the full context beside a prompt's later chunk, on the
    CPU's attention path, which gathers), run in full on the CPU: every tensor they make,
    at its peak, within the planner's activation estimate for the same run. Shapes: a
    budget of whole prompts, many decodes over a long context, one sequence whose chunk
    is most of the budget (Mistral's sliding window and masks, Qwen3's normed heads,
    routed experts). Before the estimate counted the masks and attention's own peak, and
    the engine's profile let go of a step's hidden states, it was up to 21% short."""
    config = ModelConfig.from_dir(make_model_dir(name))
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    runner = ModelRunner(CausalLM(config).to(dtype), torch.device("cpu"), 2048, block_size=16)
    for tokens, max_model_len, seqs in ((2048, 2048, 64), (256, 2048, 256), (2048, 128, 1)):
        with torch.inference_mode(), LiveBytes() as counted:
            runner.profile(tokens, max_model_len, seqs, full_steps=True)
        context = blocks_for(max_model_len, 16) * 16
        planned = estimates.activation_peak_bytes(config, dtype_bytes, tokens, seqs,
                                                  context_tokens=context,
                                                  kv_dtype_bytes=dtype_bytes,
                                                  gathered_sequences=seqs)
        assert counted.peak <= planned <= 1.4 * counted.peak, (tokens, max_model_len, seqs,
                                                                counted.peak, planned)


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
    batched tokens its activations were planned at 1.97 GiB; now 1.55 GiB (attention's own
    peak, its 32 query heads beside a 2,048 hidden, outweighs the narrow experts), and the
    pool gets 283 blocks more."""
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
            round(now.classes["activations"] / GiB, 2)) == (1.97, 1.55)
    assert now.kv.num_blocks - dense.kv.num_blocks == 283
