"""Helpers for the engine tests: a CPU (or KVLEDGER_TEST_DEVICE) engine on a built-in
model, stepping it until idle, the pool's emptiness and evictions, transformers' greedy
tokens for the same checkpoint, and a schema that is heavy to compile."""

from __future__ import annotations

import os

import torch

from kvledger.engine.core.engine import LLMEngine
from kvledger.engine.settings.config import EngineConfig

DEVICE = os.environ.get("KVLEDGER_TEST_DEVICE", "cpu")


def hf_greedy(model_dir, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy tokens for ``prompt`` on the checkpoint (fp32, ``DEVICE``)."""
    import transformers

    model = hf_greedy.models.get(model_dir)
    if model is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        hf_greedy.models[model_dir] = model = model.to(DEVICE).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt], device=DEVICE),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=DEVICE),
                             max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


hf_greedy.models = {}


def make_engine(model_dir, **flags) -> LLMEngine:
    flags = {"max_model_len": 128, "max_num_seqs": 4, "device": "cpu", **flags}
    return LLMEngine.from_config(EngineConfig(model=str(model_dir), **flags))


def drain(engine: LLMEngine, on_step=None) -> dict:
    """Step until idle; the final output of each request by id."""
    final = {}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if on_step:
            on_step(outputs)
        for out in outputs:
            if out.finished:
                assert out.request_id not in final, "a request finished twice"
                final[out.request_id] = out
    return final


def assert_pool_empty(engine: LLMEngine) -> None:
    assert (engine.ledger.reserved_blocks, engine.ledger.used_blocks) == (0, 0)


def evictions(ledger) -> int:
    """Cached blocks the ledger's pool has evicted: the pool's own counter, which only
    tests read (no metric or endpoint serves it), so the ledger does not re-export it."""
    return ledger._pool.num_evictions


def heavy_schema(seed: int, objects: int = 120) -> dict:
    """An ``anyOf`` of objects with 30 pattern properties each: a second or more to compile
    and tens of MiB compiled, where a typical schema takes milliseconds and kilobytes."""
    return {"anyOf": [{"type": "object", "patternProperties": {
        f"^s{seed}_{i}_{j}[a-z]{{2,8}}$": {"type": "string",
                                           "pattern": f"^[a-f0-9]{{{j + 1},{j + 9}}}x{i}$"}
        for j in range(30)}} for i in range(objects)]}
