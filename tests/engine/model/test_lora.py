"""LoRA adapters in the engine: an adapter's greedy tokens equal transformers + peft's on
the same weights (fp32, CPU); the base model's are unchanged by adapters being loaded; a
batch mixing adapters and the base gives every request the tokens it gets alone; at most
``max_loras`` adapters run at once (the others wait); adapters that cannot run are
refused by name."""

from __future__ import annotations

import pytest
import torch
from _engine_helpers import hf_greedy, make_engine
from _lora_helpers import peft_greedy, write_adapter

from kvledger.engine import LLM, LoRARequest, SamplingParams
from kvledger.engine.errors import BadInput
from kvledger.engine.settings.lora_config import LoraModule

PROMPTS = [[5, 17, 42, 9, 33, 7, 120, 64, 3, 88, 21], [11, 2, 250, 19], list(range(30, 70))]
GREEDY = SamplingParams(temperature=0, max_tokens=16)


def _llm(model_dir, **flags) -> LLM:
    flags = {"max_model_len": 128, "max_num_seqs": 9, "device": "cpu", **flags}
    return LLM(str(model_dir), enable_lora=True, **flags)


@pytest.mark.parametrize(("model", "adapter"), [
    ("tiny-llama", {"rank": 8, "alpha": 16}),
    ("tiny-llama", {"rank": 4, "alpha": 8, "targets": ("q_proj", "v_proj"), "use_rslora": True}),
    ("tiny-qwen2", {"rank": 16, "alpha": 32, "targets": ("k_proj", "o_proj", "down_proj")}),
    ("tiny-qwen3", {"rank": 2, "alpha": 4, "targets": ("gate_proj", "up_proj"), "seed": 3}),
])
def test_adapter_greedy_tokens_equal_transformers_peft(make_model_dir, tmp_path, model, adapter):
    model_dir = make_model_dir(model)
    adapter_dir = write_adapter(tmp_path / "adapter", model_dir, **adapter)
    llm = _llm(model_dir)
    lora = LoRARequest("a", 1, str(adapter_dir))
    outputs = llm.generate(PROMPTS, GREEDY, lora_request=lora)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        expected = peft_greedy(model_dir, adapter_dir, prompt, 16)
        assert out.token_ids == expected
        assert expected != hf_greedy(str(model_dir), prompt, 16)  # the adapter matters


def test_base_and_mixed_batch_give_each_request_its_tokens_alone(make_model_dir, tmp_path):
    """Two adapters and the base model in the same steps (the same prompt for all three:
    the prefix cache keeps each one's K/V apart); each request's tokens are those it gets
    alone, the base model's those of transformers without an adapter."""
    model_dir = make_model_dir("tiny-llama")
    first = LoRARequest("first", 1, str(write_adapter(tmp_path / "a", model_dir, seed=1)))
    second = LoRARequest("second", 2, str(write_adapter(tmp_path / "b", model_dir, rank=16,
                                                        alpha=8, seed=2)))
    llm = _llm(model_dir, max_loras=2)
    alone = {}
    for lora in (None, first, second):
        for i, prompt in enumerate(PROMPTS):
            alone[i, lora] = llm.generate([prompt], GREEDY, lora_request=lora)[0].token_ids
    cases = [(i, lora) for lora in (first, None, second) for i in range(len(PROMPTS))]
    batches = []
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule
    scheduler.schedule = lambda: batches.append(schedule()) or batches[-1]
    mixed = llm.generate([PROMPTS[i] for i, _ in cases], GREEDY,
                         lora_request=[lora for _, lora in cases])
    assert len(batches[0].prefills) == len(cases)  # all nine prefilled in one step
    for (i, lora), out in zip(cases, mixed, strict=True):
        assert out.token_ids == alone[i, lora], (i, lora)
    for i, prompt in enumerate(PROMPTS):
        assert alone[i, None] == hf_greedy(str(model_dir), prompt, 16)
        assert alone[i, first] != alone[i, None] and alone[i, second] != alone[i, first]


def test_more_adapters_than_slots_wait_for_one(make_model_dir, tmp_path):
    """With one slot, requests for three adapters and the base all finish, with the same
    tokens, and no step ever runs two adapters."""
    model_dir = make_model_dir("tiny-llama")
    loras = [LoRARequest(f"a{i}", i + 1, str(write_adapter(tmp_path / f"a{i}", model_dir,
                                                           seed=10 + i))) for i in range(3)]
    llm = _llm(model_dir, max_loras=1)
    alone = [llm.generate([PROMPTS[0]], GREEDY, lora_request=lora)[0].token_ids
             for lora in loras]
    engine = llm.engine
    seen = []
    step = engine.step

    def counting_step():
        running = engine.scheduler.running.values()
        seen.append({s.lora.lora_int_id for s in running if s.lora is not None})
        return step()

    engine.step = counting_step
    requests = [None, *loras, *loras]
    outs = llm.generate([PROMPTS[0]] * len(requests), GREEDY, lora_request=requests)
    assert max(len(s) for s in seen) == 1 and len(set().union(*seen)) == 3
    assert [o.token_ids for o in outs[1:]] == alone + alone
    assert outs[0].token_ids == hf_greedy(str(model_dir), PROMPTS[0], 16)


def test_served_adapters_are_checked_at_start(make_model_dir, tmp_path):
    model_dir = make_model_dir("tiny-llama")
    good = write_adapter(tmp_path / "good", model_dir)
    engine = make_engine(model_dir, enable_lora=True,
                         lora_modules=(LoraModule("good", str(good)),))
    assert list(engine.loras.served) == ["good"]
    assert engine.runner.lora.bytes == engine.plan.classes["lora"] > 0  # planned as allocated
    wide = write_adapter(tmp_path / "wide", model_dir, rank=32)
    with pytest.raises(BadInput, match=r"'wide'.*rank 32 is over --max-lora-rank 16"):
        make_engine(model_dir, enable_lora=True, lora_modules=(LoraModule("wide", str(wide)),))


@pytest.mark.parametrize(("make", "message"), [
    (lambda d, m: write_adapter(d, m, rank=32), r"rank 32 is over --max-lora-rank 16"),
    (lambda d, m: write_adapter(d, m, targets=("q_proj",), target_modules=["embed_tokens"]),
     r"target module 'embed_tokens' is not one kvledger adapts"),
    (lambda d, m: write_adapter(d, m, use_dora=True), r"use_dora"),
    (lambda d, m: write_adapter(d, m, bias="all"), r"bias 'all'"),
    (lambda d, m: d, r"not a PEFT LoRA adapter directory this server can read"),
    (lambda d, m: write_adapter(d, m, scale=float("nan")), r"lora_A holds values that are not finite"),
    (lambda d, m: write_adapter(d, m, alpha=float("nan")), r"lora_alpha must be a finite number"),
    (lambda d, m: write_adapter(d, m, alpha=float("inf")), r"lora_alpha must be a finite number"),
    (lambda d, m: write_adapter(d, m, target_modules=[["q_proj"]]),
     r"target_modules must be a list of module names"),
    (lambda d, m: _nested_config(write_adapter(d, m)), r"adapter_config.json: JSON nested too deeply"),
    (lambda d, m: _int_weights(write_adapter(d, m)), r"is I32; LoRA weights must be one of F32"),
])
def test_adapters_that_cannot_run_are_refused_by_name(make_model_dir, tmp_path, make, message):
    model_dir = make_model_dir("tiny-llama")
    llm = _llm(model_dir)
    path = make(tmp_path / "bad", model_dir)
    with pytest.raises(BadInput, match=r"LoRA adapter 'bad'.*" + message):
        llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("bad", 1, str(path)))
    assert not llm.engine.has_unfinished_requests()


def _nested_config(path):
    (path / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    return path


def _int_weights(path):
    """The same tensors, as 32-bit integers."""
    from safetensors.torch import load_file, save_file

    weights = path / "adapter_model.safetensors"
    save_file({k: v.to(torch.int32) for k, v in load_file(str(weights)).items()}, str(weights))
    return path


def test_an_adapter_of_the_wrong_shape_is_refused_from_its_header(make_model_dir, tmp_path,
                                                                  monkeypatch):
    """The shapes and dtypes are checked from the safetensors header before any tensor is
    read: a wrong file costs its header, whatever its size."""
    import safetensors

    other = write_adapter(tmp_path / "other", make_model_dir("tiny-qwen2"))
    llm = _llm(make_model_dir("tiny-llama"))

    def read_nothing(*args, **kwargs):
        raise AssertionError("tensor data read before the header was checked")

    monkeypatch.setattr(safetensors, "safe_open", read_nothing)
    with pytest.raises(BadInput, match=r"'qwen'.*lora_A \(8, \d+\) .*needs"):
        llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("qwen", 1, str(other)))


def test_an_adapter_for_another_base_model_is_refused_by_its_shapes(make_model_dir, tmp_path):
    other = write_adapter(tmp_path / "other", make_model_dir("tiny-qwen2"))
    llm = _llm(make_model_dir("tiny-llama"))
    with pytest.raises(BadInput, match=r"'qwen'.*lora_A \(8, \d+\) .*needs"):
        llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("qwen", 1, str(other)))


def test_lora_needs_enable_lora_and_a_dense_model(make_model_dir, tmp_path):
    model_dir = make_model_dir("tiny-llama")
    adapter = write_adapter(tmp_path / "a", model_dir)
    llm = LLM(str(model_dir), max_model_len=128, device="cpu")
    with pytest.raises(BadInput, match="without --enable-lora"):
        llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("a", 1, str(adapter)))
    with pytest.raises(BadInput, match="--lora-modules needs --enable-lora"):
        make_engine(model_dir, lora_modules=(LoraModule("a", str(adapter)),))
    with pytest.raises(BadInput, match="mixture of experts"):
        make_engine(make_model_dir("tiny-mixtral"), enable_lora=True)
    with pytest.raises(BadInput, match="--max-cpu-loras 1 is below --max-loras 2"):
        make_engine(model_dir, enable_lora=True, max_loras=2, max_cpu_loras=1)
