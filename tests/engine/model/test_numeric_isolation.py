"""Nothing one request computes reaches another's tokens, by construction: NaN written
into one request's KV blocks, or an adapter of NaN weights batched with others, leaves
every other request's tokens those of a clean run, in the same batch and afterwards on
the blocks it used; the poisoned request fails alone (its logits are not finite) and
its blocks leave the prefix cache.

Before: decode groups were padded with block 0 (anyone's), reused blocks kept their last
owner's values past the new owner's tokens, and both were hidden by an additive -inf mask,
which a NaN in V survives; LoRA slots were applied as ``(x A_all^T) * mask``, and NaN x 0
is NaN in every row."""

from __future__ import annotations

import pytest
from _engine_helpers import assert_pool_empty, drain, make_engine
from _lora_helpers import write_adapter

from kvledger.engine.sampling.params import SamplingParams
from kvledger.engine.settings.lora_config import LoraModule

PROMPTS = {f"r{i}": [5 + i, 17, 40 + 3 * i, 9] * (1 + i % 3) for i in range(6)}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
FLAGS = dict(max_num_seqs=8, num_gpu_blocks_override=40, block_size=4, max_model_len=64)


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen3-moe"])
def model_dir(request, make_model_dir):
    return make_model_dir(request.param)


@pytest.fixture(scope="module")
def reference(model_dir) -> dict:
    clean = make_engine(model_dir, **FLAGS)
    for request_id, prompt in PROMPTS.items():
        clean.add_request(request_id, prompt, GREEDY)
    return {rid: out.token_ids for rid, out in drain(clean).items()}


def _poison_blocks(engine, request_id: str) -> list[int]:
    """Fill every block ``request_id`` holds with NaN, in every layer, K and V."""
    seq = engine.scheduler.running[request_id]
    blocks = list(seq.block_ids)
    engine.runner.kv_cache[:, :, :, blocks] = float("nan")
    return blocks


def test_nan_in_one_requests_kv_reaches_no_other_request(model_dir, reference):
    """The poisoned request draws block 0 first (every decode group used to pad with it);
    its blocks are NaN from its first step on. The others, batched with it, get their
    clean tokens; it fails alone with a clear error; a second round of the same prompts,
    drawing the blocks it used, gets them again."""
    engine = make_engine(model_dir, **FLAGS)
    engine.add_request("poisoned", [60, 61, 62, 63, 64, 65, 66], GREEDY)
    engine.step()
    poisoned = _poison_blocks(engine, "poisoned")
    assert 0 in poisoned
    for request_id, prompt in PROMPTS.items():
        engine.add_request(request_id, prompt, GREEDY)
    final = drain(engine)
    failed = final.pop("poisoned")
    assert failed.finish_reason == "error" and "not finite" in failed.error
    assert {rid: out.token_ids for rid, out in final.items()} == reference
    # Every free block now holds NaN (the poisoned request's among them): their next
    # owners write only part of some, and read none of what was there before.
    free = list(engine.ledger._pool._free)
    assert set(poisoned) <= set(free)
    engine.runner.kv_cache[:, :, :, free] = float("nan")
    for request_id, prompt in PROMPTS.items():
        engine.add_request(f"again-{request_id}", [p + 1 for p in prompt], GREEDY)
    again = drain(engine)
    assert all(out.finish_reason == "length" for out in again.values())
    for request_id, prompt in PROMPTS.items():
        engine.add_request(f"last-{request_id}", prompt, GREEDY)
    last = drain(engine)
    assert {rid.removeprefix("last-"): out.token_ids for rid, out in last.items()} == reference
    assert_pool_empty(engine)


def test_a_failed_requests_blocks_leave_the_prefix_cache(tiny_llama_dir):
    """A request whose logits went non-finite may have written NaN K/V: a later request
    with the same prompt computes its own rather than finding those blocks."""
    engine = make_engine(tiny_llama_dir, **FLAGS)
    prompt = list(range(70, 86))  # 4 full blocks
    engine.add_request("poisoned", prompt, GREEDY)
    engine.step()  # the whole prompt computed and registered
    _poison_blocks(engine, "poisoned")
    assert drain(engine)["poisoned"].finish_reason == "error"
    hits = engine.ledger.prefix_cache.hits
    engine.add_request("same", prompt, GREEDY)
    assert drain(engine)["same"].finish_reason == "length"
    assert engine.ledger.prefix_cache.hits == hits  # nothing found: computed again


def test_an_adapter_of_nan_weights_reaches_no_other_row(tiny_llama_dir, tmp_path):
    """Two slots: requests for adapter ``good`` and for the base model, batched with
    requests for ``bad`` whose weights became NaN after loading (a fault the load check
    cannot see): every good and base request gets the tokens it gets alone; each bad one
    fails alone."""
    good, bad = (write_adapter(tmp_path / name, tiny_llama_dir, seed=seed)
                 for name, seed in (("good", 1), ("bad", 2)))
    flags = dict(FLAGS, enable_lora=True, max_loras=2, max_num_seqs=24, num_gpu_blocks_override=120,
                 lora_modules=(LoraModule("good", str(good)), LoraModule("bad", str(bad))))

    def run(poison: bool) -> dict:
        engine = make_engine(tiny_llama_dir, **flags)
        served = engine.loras.served
        adapters = {name: engine.resolve_lora(served[name]) for name in ("good", "bad")}
        if poison:
            for a, b in adapters["bad"].weights.values():
                a.fill_(float("nan"))
                b.fill_(float("nan"))
        for request_id, prompt in PROMPTS.items():
            for lora in (None, "good", "bad"):
                request = engine.check_request(prompt, GREEDY, served[lora] if lora else None)
                engine.add_request(f"{request_id}-{lora}", request)
        return drain(engine)

    clean, poisoned = run(False), run(True)
    for request_id, out in poisoned.items():
        if request_id.endswith("-bad"):
            assert out.finish_reason == "error" and "not finite" in out.error
        else:
            assert out.token_ids == clean[request_id].token_ids, request_id

