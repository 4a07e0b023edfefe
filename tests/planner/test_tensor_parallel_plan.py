"""--tensor-parallel-size N (issue 23): the plan is what ONE GPU holds when the model is
sharded as vLLM shards it: column/row-parallel linear layers, the vocabulary split
(padded), norms replicated, KV heads split and replicated once N exceeds them, experts
split; each rank's context plus NCCL's buffers. Shapes that cannot be split are refused by
name (exit 2); more GPUs is a remedy, verified by re-planning."""

from __future__ import annotations

import json

import pytest
from budget_checkpoints import write_header_only
from published_models import published_config, published_tensors

from kvledger.engine.cli import main
from kvledger.engine.errors import BadInput
from kvledger.engine.planner import estimates
from kvledger.engine.planner.plan import make_plan
from kvledger.engine.settings.config import EngineConfig

GiB = 2**30
# Llama-3-70B, bf16
H, INTER, V, LAYERS, HEAD, KV_HEADS = 8192, 28672, 128256, 80, 128, 8


@pytest.fixture(scope="module")
def llama_70b(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-3-70b")
    config = published_config("Llama-3-70B")
    write_header_only(path, config, published_tensors(config))
    return path


def _plan(model_dir, **flags):
    flags = {"device_memory_bytes": 80 * GiB, "max_model_len": 8192, **flags}
    return make_plan(EngineConfig(model=str(model_dir), **flags))


def _weights_per_gpu(tp: int) -> int:
    """Llama-3-70B's bf16 bytes on one of ``tp`` GPUs, written out by hand."""
    kv_heads = max(1, KV_HEADS // tp)
    vocab = -(-V // 64) * 64 // tp  # 128256 is a multiple of 64 already
    per_layer = (H * H // tp                       # q_proj: column
                 + 2 * kv_heads * HEAD * H         # k_proj, v_proj: the rank's KV heads
                 + H * H // tp                     # o_proj: row
                 + 3 * INTER * H // tp                 # gate, up (column), down (row)
                 + 2 * H)                          # the two norms, replicated
    return 2 * (LAYERS * per_layer + 2 * vocab * H + H)


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_llama_3_70b_weights_per_gpu_are_its_shards(llama_70b, tp) -> None:
    plan = _plan(llama_70b, tensor_parallel_size=tp)
    assert plan.classes["weights"] == _weights_per_gpu(tp)
    assert plan.tensor_parallel_size == tp


def test_kv_heads_split_then_replicate(llama_70b) -> None:
    """8 KV heads: 4 per GPU at 2, 1 at 8, and still 1 (each head on two GPUs) at 16."""
    per_token = {tp: _plan(llama_70b, tensor_parallel_size=tp).kv.bytes_per_token
                 for tp in (1, 2, 8, 16)}
    assert per_token[1] == 2 * LAYERS * KV_HEADS * HEAD * 2
    assert per_token[2] == per_token[1] // 2
    assert per_token[8] == per_token[16] == per_token[1] // 8


def test_each_rank_has_its_context_and_nccl_buffers(llama_70b) -> None:
    one, two = (_plan(llama_70b, tensor_parallel_size=tp) for tp in (1, 2))
    assert one.classes["context"] == estimates.CUDA_CONTEXT_BYTES
    assert two.classes["context"] == estimates.CUDA_CONTEXT_BYTES + 128 * 2**20
    assert estimates.NCCL_BYTES_PER_RANK == 4 * 2**20 * 16 * 2


@pytest.mark.parametrize("backend", ["TRITON_ATTN", "TORCH_SDPA"])
def test_activations_are_one_ranks_heads_and_mlp(llama_70b, backend) -> None:
    one, two = (_plan(llama_70b, tensor_parallel_size=tp, enforce_eager=True,
                      attention_backend=backend) for tp in (1, 2))
    t = one.max_num_batched_tokens
    halved = t * ((64 + 2 * 8) * HEAD // 2 + 3 * INTER // 2) * 2  # q/k/v and the MLP, one rank's
    whole = t * ((64 + 2 * 8) * HEAD + 3 * INTER) * 2
    # TORCH_SDPA gathers max_num_seqs x context x K,V (bf16), each rank its KV heads' share;
    # TRITON_ATTN nothing (decodes and later chunks read the pool in place)
    gather = (16 if backend == "TORCH_SDPA" else 0) * 8192 * KV_HEADS * HEAD * 2 * 2
    assert one.classes["activations"] - two.classes["activations"] == whole - halved + gather // 2


def test_70b_is_refused_on_one_80gib_gpu_with_more_gpus_as_a_remedy(llama_70b, capsys) -> None:
    """The smallest size that fits: 16 sequences of 8192 tokens need 4 GPUs (3 does not
    divide the heads, 2 is 10 GiB short); 4 sequences fit on 2."""
    plan = _plan(llama_70b)
    assert not plan.fits
    remedy = next(r for r in plan.remedies if r.flag == "--tensor-parallel-size")
    assert remedy.value == 4 and remedy.kv_bytes == 40 * GiB // 4
    assert not _plan(llama_70b, tensor_parallel_size=2).fits
    assert _plan(llama_70b, tensor_parallel_size=4).fits  # the remedy re-planned
    fewer = _plan(llama_70b, max_num_seqs=4).remedies
    assert [r.value for r in fewer if r.flag == "--tensor-parallel-size"] == [2]
    assert main(["plan", "--model", str(llama_70b), "--device-memory", "80GiB",
                 "--max-model-len", "8192"]) == 3
    assert "--tensor-parallel-size 4  (per GPU, x 4 GPUs" in capsys.readouterr().err


def test_no_more_gpus_remedy_where_ranks_share_one_memory(llama_70b) -> None:
    plan = _plan(llama_70b, unified_memory=True, device_memory_bytes=120 * GiB)
    assert not plan.fits
    assert all(r.flag != "--tensor-parallel-size" for r in plan.remedies)


def test_ranks_in_one_memory_share_the_limit(tiny_llama_dir) -> None:
    cpu = {"unified_memory": True, "device_memory_bytes": 8 * GiB,
           "memory_limit_bytes": 4 * GiB}
    one = make_plan(EngineConfig(model=str(tiny_llama_dir), **cpu))
    two = make_plan(EngineConfig(model=str(tiny_llama_dir), tensor_parallel_size=2, **cpu))
    assert two.limit_bytes == one.limit_bytes // 2


def test_the_cli_json_and_report_say_per_gpu(llama_70b, capsys) -> None:
    argv = ["plan", str(llama_70b), "--device-memory", "80GiB", "--max-model-len", "8192"]
    assert main([*argv, "-tp", "4", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["tensor_parallel_size"] == 4
    assert plan["classes"]["weights"] == _weights_per_gpu(4)
    assert main([*argv, "--tensor-parallel-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "per GPU, x 4 GPUs" in out and "limit is" in out and "GiB per GPU" in out


@pytest.mark.parametrize(("tp", "why"), [
    (3, "LlamaForCausalLM has 64 attention heads"),
    (6, "LlamaForCausalLM has 64 attention heads")])
def test_a_size_the_heads_do_not_divide_into_is_refused_by_name(llama_70b, capsys, tp,
                                                                 why) -> None:
    with pytest.raises(BadInput, match=f"--tensor-parallel-size {tp}: {why}"):
        _plan(llama_70b, tensor_parallel_size=tp)
    assert main(["plan", str(llama_70b), "--device-memory", "80GiB", "-tp", str(tp)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and why in err


def test_kv_heads_that_a_size_neither_divides_nor_multiplies_are_refused(tmp_path) -> None:
    config = published_config("Llama-3-70B") | {"num_attention_heads": 48, "head_dim": 128,
                                                  "num_key_value_heads": 12}
    write_header_only(tmp_path, config, published_tensors(config))
    with pytest.raises(BadInput, match="--tensor-parallel-size 8: LlamaForCausalLM has 12 KV"):
        _plan(tmp_path, tensor_parallel_size=8)


def test_moe_experts_are_split_and_the_router_replicated(tmp_path) -> None:
    config = published_config("Mixtral-8x7B")
    write_header_only(tmp_path, config, published_tensors(config))
    one, two = (_plan(tmp_path, tensor_parallel_size=tp, max_model_len=4096).classes["weights"]
                for tp in (1, 2))
    h, layers, experts = 4096, 32, 8
    router = layers * experts * h * 2
    norms = (2 * layers + 1) * h * 2
    # Everything else halves: the vocabulary (32000, a multiple of 64), q/k/v/o (8 KV
    # heads, 4 a rank) and every expert's w1/w2/w3.
    assert one - two == (one - router - norms) // 2


def test_plan_takes_vllms_multi_node_flags_and_serve_checks_them(tiny_llama_dir, capsys,
                                                                 monkeypatch) -> None:
    """A plan is per GPU of each stage wherever the stages run: plan takes the machines'
    flags as they are; serve runs them (tests/engine/core/test_nodes.py), and refuses a run the
    machines cannot split evenly, one line, exit 2."""
    nodes = ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
             "--master-port", "29500"]
    assert main(["plan", str(tiny_llama_dir), "--device-memory", "8GiB", "-pp", "2",
                 *nodes]) == 0
    capsys.readouterr()
    monkeypatch.setenv("KVLEDGER_NODE_KEY", "k" * 32)
    assert main(["serve", str(tiny_llama_dir), "--device", "cpu", "-pp", "3", *nodes]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("error: --nnodes 2: the 3 ranks (--tensor-parallel-size x "
                          "--pipeline-parallel-size) do not split evenly over 2 machines")


@pytest.mark.parametrize("flag", [["--data-parallel-size", "2"]])
def test_data_parallel_is_refused_by_name(tiny_llama_dir, capsys, flag) -> None:
    assert main(["plan", str(tiny_llama_dir), "--device", "cpu", *flag]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {flag[0]} 2: kvledger does not")


@pytest.mark.parametrize("command", ["plan", "preflight", "serve"])
@pytest.mark.parametrize(("flag", "field"), [
    ("--tensor-parallel-size", "tensor_parallel_size"), ("-tp", "tensor_parallel_size"),
    ("--tensor_parallel_size", "tensor_parallel_size"),
    ("--pipeline-parallel-size", "pipeline_parallel_size"), ("-pp", "pipeline_parallel_size"),
    ("--pipeline_parallel_size", "pipeline_parallel_size")])
def test_every_command_reads_the_flag(command, flag, field) -> None:
    from kvledger.engine.cli import build_parser
    from kvledger.engine.settings.config_flags import config_from_args
    from kvledger.engine.settings.launch_line import dashed

    config = config_from_args(build_parser(command).parse_args(dashed(["/m", flag, "2"])))
    assert getattr(config, field) == 2
    assert config.to_flags() == ["--model", "/m", "--" + field.replace("_", "-"), "2"]


def test_a_size_below_one_is_bad_input(tiny_llama_dir, capsys) -> None:
    assert main(["plan", str(tiny_llama_dir), "--device", "cpu", "-tp", "0"]) == 2
    assert "expected a positive integer" in capsys.readouterr().err
    with pytest.raises(BadInput, match="--tensor-parallel-size must be a positive integer"):
        EngineConfig(model="/m", tensor_parallel_size=0)


def test_quantized_weights_are_not_sharded_and_the_plan_says_so_first(tiny_llama_dir, llama_70b,
                                                                       tmp_path, capsys) -> None:
    """The engine refuses to shard quantized weights at start-up; the pre-flight refuses the
    same before anything starts (a plan that fits, then an engine that exits, would be a
    crash loop). Unquantized, and on one GPU, they plan."""
    from _fp8_checkpoints import write_fp8

    fp8_dir, _ = write_fp8(tiny_llama_dir, tmp_path, per_channel=True, static=False)
    for model, extra, named in ((fp8_dir, [], "fp8"),
                                (llama_70b, ["--quantization", "fp8"], "fp8")):
        argv = ["plan", str(model), "--device-memory", "80GiB", *extra]
        assert main([*argv, "-tp", "2"]) == 2
        err = capsys.readouterr().err
        assert err == (f"error: --tensor-parallel-size 2: kvledger's engine does not shard "
                       f"{named} weights yet (serve them on one GPU, or unquantized)\n")
        assert main([*argv, "--max-model-len", "512"]) in (0, 3)
        capsys.readouterr()
