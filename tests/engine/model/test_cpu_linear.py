"""The CPU's linear layers on oneDNN's packed weights: the same products as nn.Linear to
float rounding, every untied layer swapped at start-up where a sample measured faster
packed, the weights counted and held once."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from _engine_helpers import make_engine
from torch import nn

from kvledger.engine.model import cpu_linear
from kvledger.engine.model.cpu_linear import PackedLinear, pack_linears, packable
from kvledger.engine.model.loader import weights_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_a_packed_layer_computes_what_nn_linear_computes(dtype, bias):
    if not packable(dtype):  # bfloat16 needs AVX-512 or AVX-NE-CONVERT
        pytest.skip(f"this CPU's oneDNN cannot pack {dtype}")
    torch.manual_seed(0)
    dense = nn.Linear(512, 1408, bias=bias).to(dtype).requires_grad_(False)
    packed = PackedLinear(dense.weight, dense.bias)
    for rows in (1, 2, 3, 8, 33, 300):
        x = torch.randn(rows, 512, dtype=dtype)
        want, got = dense(x).float(), packed(x).float()
        assert got.shape == want.shape
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        assert (got - want).abs().max() <= tolerance * want.abs().max()
    x = torch.randn(2, 3, 512, dtype=dtype)  # leading dimensions kept
    assert packed(x).shape == (2, 3, 1408)


def test_an_engine_on_the_cpu_runs_every_untied_linear_packed(make_model_dir):
    for name in ("tiny-llama", "tiny-qwen3-moe"):
        engine = make_engine(make_model_dir(name))
        model = engine.runner.model
        assert not any(isinstance(m, nn.Linear) for m in model.modules()
                       if m is not model.lm_head)
        assert sum(isinstance(m, PackedLinear) for m in model.modules()) > 0


def test_tied_weights_and_other_devices_stay_dense():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(64, 16)
            self.proj = nn.Linear(16, 16)
            self.lm_head = nn.Linear(16, 64, bias=False)
            self.lm_head.weight = self.embed_tokens.weight

    model = Tied().requires_grad_(False)
    before = weights_bytes(model)
    assert pack_linears(model, torch.device("meta")) == 0
    assert pack_linears(model, torch.device("cpu")) == 1  # proj; lm_head shares the embedding
    assert isinstance(model.proj, PackedLinear) and isinstance(model.lm_head, nn.Linear)
    assert weights_bytes(model) == before  # the packed copy replaced the dense weight


def test_a_dtype_this_cpu_cannot_pack_stays_dense_and_the_rest_is_packed(monkeypatch):
    """On an AVX2-only CPU torch refuses to reorder bfloat16 weights: those layers keep
    nn.Linear (MKL) while float32 layers beside them are packed."""
    reorder = torch.ops.mkldnn._reorder_linear_weight

    def avx2_only(weight, rows):
        if weight.dtype == torch.bfloat16:
            raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support "
                               "avx_ne_convert or avx512bw, avx512vl and avx512dq")
        return reorder(weight, rows)

    monkeypatch.setattr(cpu_linear.torch.ops.mkldnn, "_reorder_linear_weight", avx2_only)
    packable.cache_clear()
    try:
        assert packable(torch.float32) and not packable(torch.bfloat16)
        model = nn.ModuleDict({"f32": nn.Linear(16, 32), "bf16": nn.Linear(16, 32).bfloat16()})
        assert pack_linears(model, torch.device("cpu")) == 1
        assert isinstance(model["f32"], PackedLinear) and isinstance(model["bf16"], nn.Linear)
        x = torch.randn(3, 16, dtype=torch.bfloat16)
        assert model["bf16"](x).shape == (3, 32)
    finally:
        monkeypatch.undo()
        packable.cache_clear()


def _layers(n: int) -> nn.ModuleDict:
    return nn.ModuleDict({f"l{i}": nn.Linear(64, 64) for i in range(n)}).requires_grad_(False)


@pytest.mark.parametrize("packed_faster", [True, False])
def test_packing_is_kept_only_where_the_start_up_sample_ran_faster(monkeypatch, packed_faster):
    """A model large enough to measure: the first layers up to SAMPLE_BYTES are timed
    dense and packed, and all are packed only when packed ran the sample faster."""
    layer_bytes = 64 * 64 * 4
    monkeypatch.setattr(cpu_linear, "MEASURE_MIN_BYTES", 6 * layer_bytes)
    monkeypatch.setattr(cpu_linear, "SAMPLE_BYTES", 3 * layer_bytes)
    timed = []

    def sweep(layers, rows):
        timed.append((rows, [type(layer) for layer in layers]))
        packed = isinstance(layers[0], PackedLinear)
        return 1.0 if packed == packed_faster else 2.0

    monkeypatch.setattr(cpu_linear, "sweep_seconds", sweep)
    model = _layers(8)
    assert pack_linears(model, torch.device("cpu")) == 8 * packed_faster
    assert all(isinstance(m, PackedLinear if packed_faster else nn.Linear)
               for m in model.values())
    # dense then packed at each sample row count, over the first three layers
    assert [(rows, kinds[0]) for rows, kinds in timed] == [
        (rows, kind) for rows in cpu_linear.SAMPLE_ROWS for kind in (nn.Linear, PackedLinear)]
    assert all(len(kinds) == 3 for _, kinds in timed)

    timed.clear()  # a smaller model, or measure=False: packed without timing anything
    assert pack_linears(_layers(5), torch.device("cpu")) == 5
    assert pack_linears(_layers(8), torch.device("cpu"), measure=False) == 8
    assert timed == []


def test_the_start_up_sample_runs_both_forms_and_logs_its_choice(caplog):
    dense = list(_layers(4).values())
    packed = [PackedLinear(layer.weight, layer.bias) for layer in dense]
    assert cpu_linear.sweep_seconds(dense, 4) > 0 and cpu_linear.sweep_seconds(packed, 4) > 0
    with caplog.at_level("INFO", logger="kvledger.engine"):
        pays = cpu_linear.packing_pays(dense, packed)
    assert pays in (True, False)
    assert ("packed (oneDNN" if pays else "left on nn.Linear (oneDNN") in caplog.text
    assert "over 4 layers at 1/4/16 rows" in caplog.text


def test_the_dense_weights_are_let_go_once_packed():
    model = _layers(4)
    weights = [weakref.ref(layer.weight) for layer in model.values()]
    assert pack_linears(model, torch.device("cpu"), measure=False) == 4
    gc.collect()
    assert all(ref() is None for ref in weights)  # held once: packed, not twice
