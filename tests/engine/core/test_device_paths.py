"""The runner's device paths without a GPU: the model on the ``meta`` device, where an
op fails when a CPU tensor meets a tensor on the model's device (as it would on CUDA).
So every index, position, mask, slot and scratch tensor the runner makes must follow
the model's device; meta computes shapes only, so full-size steps cost nothing."""

from __future__ import annotations

import pytest
import torch

from kvledger.engine.checkpoint.model_config import ModelConfig
from kvledger.engine.core.profile_steps import mixed_step
from kvledger.engine.core.runner import ModelRunner
from kvledger.engine.core.scheduler import Scheduler
from kvledger.engine.core.sequence import Sequence
from kvledger.engine.kv.ledger import KVLedger
from kvledger.engine.model.loader import load_model
from kvledger.engine.model.transformer import CausalLM
from kvledger.engine.sampling.params import SamplingParams
from kvledger.engine.sampling.sampler import Sampler

META = torch.device("meta")


def meta_runner(model_dir, max_model_len: int, dtype=torch.bfloat16) -> ModelRunner:
    with META:
        model = CausalLM(ModelConfig.from_dir(model_dir)).to(dtype)
    return ModelRunner(model, META, max_model_len, block_size=16)


def test_a_cpu_tensor_meeting_the_meta_model_fails():
    # The premise of this file: meta refuses mixed devices, as CUDA does.
    with pytest.raises(RuntimeError, match="device"):
        torch.zeros(2, device=META) + torch.ones(2)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3"])
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_profile_runs_both_steps_on_the_model_device(make_model_dir, name, kv_dtype):
    runner = meta_runner(make_model_dir(name), max_model_len=4096)
    # A mixed step of 255 decodes at 4096 tokens plus a 1793-token chunk that attends to
    # its cached context (and crosses Mistral's window), then a prefill of 2048 tokens.
    assert runner.profile(2048, 4096, 256, kv_dtype) is None  # meta keeps no statistics
    # A budget above a prompt: the mixed step's prompt tokens are whole prompts.
    assert runner.profile(300, 128, 8, kv_dtype) is None


@pytest.mark.parametrize(("tokens", "max_model_len", "seqs"), [(2048, 4096, 256), (300, 128, 8),
                                                              (64, 2048, 64), (32, 2048, 1)])
def test_the_mixed_profile_step_is_a_step_the_scheduler_can_make(tiny_llama_dir, tokens,
                                                                 max_model_len, seqs):
    runner = meta_runner(tiny_llama_dir, max_model_len)
    ids, positions, meta, last_index = mixed_step(runner.attention, tokens, max_model_len, seqs)
    decodes = sum(g.num_seqs for g in meta.decode_groups)
    assert decodes == min(seqs, tokens) - 1
    assert len(ids) == len(positions) == meta.slot_mapping.shape[0] == tokens
    assert sum(span.length for span in meta.prefills) + decodes == tokens
    assert all(p < max_model_len - 1 for p in positions[:tokens - decodes])  # prompts < context
    assert positions[tokens - decodes:] == [max_model_len - 1] * decodes
    chunk = meta.prefills[0]
    assert chunk.block_table is not None and chunk.start + chunk.length == max_model_len - 1
    assert sorted(set(last_index)) == last_index and last_index[-1] == tokens - 1
    assert len(last_index) == decodes + len(meta.prefills)  # a logits row per sequence


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_scheduled_steps_with_chunks_and_decode_groups_run_on_the_model_device(tiny_llama_dir,
                                                                               kv_dtype):
    run_scheduled_steps(meta_runner(tiny_llama_dir, max_model_len=256), kv_dtype)


@pytest.mark.parametrize("name", ["tiny-mixtral", "tiny-qwen3-moe"])
def test_moe_models_run_the_profile_and_scheduled_steps_through_the_real_routing(
        make_model_dir, name):
    """Routing reads each expert's token count back to the host, which the meta device
    cannot: the MoE models run on the CPU (on CUDA: bench/gpu_checks.sh's equality run)."""
    model_dir = make_model_dir(name)
    cpu = torch.device("cpu")
    model = load_model(model_dir, ModelConfig.from_dir(model_dir), torch.float32, cpu)
    runner = ModelRunner(model, cpu, 256, block_size=16)
    assert runner.profile(300, 128, 8) is None  # the prefill step; the CPU keeps no statistics
    run_scheduled_steps(runner, "auto")


def run_scheduled_steps(runner: ModelRunner, kv_dtype: str) -> None:
    """Twelve scheduled steps of six prompts, with later chunks and decodes, on the runner's
    device: every logits row there, one per sampled sequence."""
    ledger = KVLedger(64, 16)
    runner.allocate_kv_cache(ledger.num_blocks, kv_dtype)
    assert runner.kv_cache.device == runner.device
    scheduler = Scheduler(ledger, max_num_seqs=6, max_num_batched_tokens=40)
    for i, length in enumerate([3, 90, 17, 50, 5, 33]):  # 90 and 50 go in 40-token chunks
        params = SamplingParams(temperature=0, max_tokens=20)
        seq = Sequence(f"r{i}", [7] * length, params, 20, ledger.try_reserve(length + 20),
                       None, None)
        scheduler.add(seq)
    kinds = set()
    for _ in range(12):
        batch = scheduler.schedule()
        kinds |= {"later chunk" for c in batch.prefills if c.start > 0}
        kinds |= {"decodes" for _ in batch.decodes}
        logits = runner.execute(batch).logits
        assert logits.device == runner.device
        assert logits.shape == (len(batch.sampled), runner.config.vocab_size)
        for chunk in batch.prefills:
            chunk.seq.num_computed_tokens += chunk.length
        for seq in batch.decodes:
            seq.num_computed_tokens += 1
        for seq in batch.sampled:
            seq.output_token_ids.append(1)
    assert kinds == {"later chunk", "decodes"}


def test_seeded_sampling_draws_on_the_logits_device_in_one_copy():
    # Per-request generators and the shared one sample tensors on their own device; the
    # sampler returns plain ints whatever mix of greedy and sampled rows a step has.
    sampler = Sampler(0, torch.device("cpu"))
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    seqs = [Sequence(f"s{i}", [1], params, 4, None, None, gen) for i, (params, gen) in enumerate([
        (SamplingParams(temperature=0), None),
        (SamplingParams(temperature=0.8, top_k=5, seed=3), torch.Generator().manual_seed(3)),
        (SamplingParams(temperature=1.0, top_p=0.5), None)])]
    token_ids = sampler(logits, seqs).token_ids
    assert all(type(t) is int for t in token_ids)
    assert token_ids[0] == int(logits[0].argmax())
    assert token_ids[1] in torch.topk(logits[1], 5).indices.tolist()
    seqs[1].generator = torch.Generator().manual_seed(3)
    again = Sampler(99, torch.device("cpu"))(logits, seqs).token_ids
    assert again[1] == token_ids[1]  # the seeded row ignores the shared generator


def test_on_the_cpu_the_profile_is_a_short_check_at_the_top_of_the_context(tiny_llama_dir,
                                                                          monkeypatch):
    """Nothing is measured on the CPU: before, its profile ran the whole prefill budget (9
    of 14 s of a 1.4 GB checkpoint's start) to learn nothing. Now one prompt of
    CPU_CHECK_TOKENS tokens runs every layer at the context's last positions, so a rotary
    table one position short still fails the start, not the first long request."""
    from kvledger.engine.core.profile_steps import CPU_CHECK_TOKENS

    cpu = torch.device("cpu")
    model = load_model(tiny_llama_dir, ModelConfig.from_dir(tiny_llama_dir), torch.float32, cpu)
    runner = ModelRunner(model, cpu, 256, block_size=16)
    seen = []
    real = ModelRunner._hidden

    def hidden(self, input_ids, positions, meta, cache):
        seen.append((len(input_ids), positions[0], positions[-1], cache))
        return real(self, input_ids, positions, meta, cache)

    monkeypatch.setattr(ModelRunner, "_hidden", hidden)
    assert runner.profile(2048, 256, 8) is None
    assert seen == [(CPU_CHECK_TOKENS, 256 - CPU_CHECK_TOKENS, 255, None)]
    again = load_model(tiny_llama_dir, ModelConfig.from_dir(tiny_llama_dir), torch.float32, cpu)
    short = ModelRunner(again, cpu, 255, block_size=16)  # its rotary table: 255 positions
    with pytest.raises(IndexError):
        short.profile(2048, 256, 8)
