"""lm-evaluation-harness (lm-eval) drives the server end to end, as its users run it.

``local-completions`` scores a multiple-choice task from the prompt logprobs that
``echo: true, logprobs: 1, max_tokens: 1`` returns (each choice's loglikelihood must equal
transformers' on the same checkpoint) and runs a generate_until task;
``local-chat-completions`` runs the generate_until task through the chat template.
Every request's KV reservation is released afterwards."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
import transformers
from _server_helpers import make_llm, wait_for_metric
from lm_eval_tasks import run_lm_eval, write_tasks

from kvledger.engine.server.app import build_app
from kvledger.engine.server.state import STATE, ServeOptions


def _reference(model_dir):
    """log P(continuation | context) by transformers, tokenized as lm-eval does."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def loglikelihood(context: str, continuation: str) -> float:
        ctx = tok(context, add_special_tokens=False).input_ids
        whole = tok(context + continuation, add_special_tokens=False).input_ids
        with torch.inference_mode():
            logprobs = model.eval()(torch.tensor([whole])).logits[0].log_softmax(-1)
        return sum(logprobs[i - 1, whole[i]].item() for i in range(len(ctx), len(whole)))

    return loglikelihood


@pytest.mark.timeout(300)
async def test_lm_eval_scores_choices_and_generates(aiohttp_server, aiohttp_client,
                                                     tiny_llama_dir, tmp_path):
    app = build_app(ServeOptions())
    server = await aiohttp_server(app, host="127.0.0.1")
    await app[STATE].attach(make_llm(tiny_llama_dir))
    base_url, name = str(server.make_url("")).rstrip("/"), app[STATE].model_name
    folder = tmp_path / "tasks"
    tasks = write_tasks(folder)

    # lm-eval's HTTP client blocks: run it off the event loop that serves.
    completions = await asyncio.to_thread(run_lm_eval, base_url, name, tiny_llama_dir,
                                          list(tasks.values()), folder, False)
    chat = await asyncio.to_thread(run_lm_eval, base_url, name, tiny_llama_dir,
                                   [tasks["generate"]], folder, True)

    reference = _reference(tiny_llama_dir)
    mc = completions[tasks["loglikelihood"]]
    assert 0.0 <= mc["acc,none"] <= 1.0 and len(mc["samples"]) == 4
    for sample in mc["samples"]:
        got = [loglikelihood for loglikelihood, _ in sample["filtered_resps"]]
        want = [reference(context, continuation) for context, continuation in sample["arguments"]]
        assert all(math.isclose(g, w, abs_tol=1e-3) for g, w in zip(got, want, strict=True)), \
            (sample["arguments"], got, want)
    for results in (completions, chat):
        gen = results[tasks["generate"]]
        assert 0.0 <= gen["exact_match,none"] <= 1.0
        assert [isinstance(s["filtered_resps"][0], str) for s in gen["samples"]] == [True] * 3
        assert not any("\n" in s["filtered_resps"][0] for s in gen["samples"])  # stop honoured

    client = await aiohttp_client(server)
    assert await wait_for_metric(client, "kvledger_kv_blocks_reserved", 0) == 0
