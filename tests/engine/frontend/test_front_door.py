"""The engine's one front door (``frontend/door.py``): the server and ``LLM`` reach the
engine only through it, so they meet the same rules, in one order, with one line."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from kvledger.engine import LLM, SamplingParams
from kvledger.engine.errors import BadInput, KVCacheFull, PoolTooSmall, UnknownModel
from kvledger.engine.frontend.door import FrontDoor, LineOptions
from kvledger.engine.frontend.offload import Offload
from kvledger.engine.frontend.submission import Submission, Tenant


@pytest.fixture(scope="module")
def published_llm(tiny_llama_dir, tmp_path_factory):
    """A model whose generation_config.json sets a default output length of 5."""
    out = tmp_path_factory.mktemp("published")
    for path in tiny_llama_dir.iterdir():
        shutil.copy(path, out / path.name)
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "max_new_tokens": 5}))
    return LLM(str(out), max_model_len=96, max_num_seqs=4, device="cpu",
               num_gpu_blocks_override=12)


def _door(llm: LLM, **line) -> FrontDoor:
    return FrontDoor(llm.engine, LineOptions(**line), Offload())


async def _served(door: FrontDoor, sub: Submission) -> tuple[list, list[str]]:
    """Every choice's final output and its finish reasons, the door started and stopped."""
    await door.start(warm=False)
    try:
        generation = await door.submit(sub)
        finals: dict[int, object] = {}
        try:
            async for index, output in generation:
                finals[index] = output
        finally:
            await generation.aclose()
        return [finals[i] for i in sorted(finals)], generation.finish_reasons
    finally:
        await door.stop()


def test_llm_and_the_server_share_the_cap_rule(published_llm):
    """No max_tokens: the model's max_new_tokens caps LLM's prompts as it caps the
    server's (before the door, LLM's cap was the rest of the context)."""
    params = SamplingParams(temperature=0, ignore_eos=True)  # max_tokens unset
    (out,) = published_llm.generate([[5, 6, 7]], params)
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    door = _door(published_llm)
    finals, reasons = asyncio.run(_served(door, Submission("s", [[5, 6, 7]], params)))
    assert finals[0].token_ids == out.token_ids and reasons == ["length"]
    assert published_llm.engine.ledger.reserved_blocks == 0


def test_one_admission_for_llm_and_server(published_llm):
    """LLM's line is built as the server's is (the same engine limits), only uncapped."""
    llm_line = published_llm._door.admission
    server_line = _door(published_llm, max_queue_len=8, max_queue_wait_s=1.0).admission
    assert llm_line.max_num_seqs == server_line.max_num_seqs == 4
    assert llm_line.headroom is server_line.headroom
    assert (llm_line.max_queue_len, server_line.max_queue_len) == (None, 8)


def test_choices_get_their_own_seed_and_the_prompt_its_cap(published_llm):
    door = _door(published_llm)
    params = SamplingParams(temperature=0.8, seed=2**64 - 1, max_tokens=None)
    sub = Submission("s", [[5, 6, 7], "The river"], params, n=2)
    finals, reasons = asyncio.run(_served(door, sub))
    assert reasons == ["length"] * 4 and all(len(f.token_ids) == 5 for f in finals)
    # Choice k is prompt k // n with seed + k % n (mod 2**64): choice 1 drew as seed 0.
    (alone,) = published_llm.generate([[5, 6, 7]], SamplingParams(temperature=0.8, seed=0))
    assert finals[1].token_ids == alone.token_ids


def test_the_same_refusals_reach_llm_and_the_server(published_llm):
    fcfs = SamplingParams(temperature=0, max_tokens=2)
    with pytest.raises(BadInput, match="needs --scheduling-policy priority") as from_llm:
        published_llm.generate([[5, 6]], fcfs, priority=[3])
    with pytest.raises(BadInput, match="needs --scheduling-policy priority") as from_door:
        asyncio.run(_served(_door(published_llm), Submission("s", [[5, 6]], fcfs, priority=3)))
    assert from_llm.value.param == from_door.value.param == "priority"
    with pytest.raises(BadInput, match="must be integers") as bad_ids:
        published_llm.generate([[5, 10**9]], fcfs)
    assert bad_ids.value.param == "prompt"
    big = SamplingParams(temperature=0, max_tokens=90)  # 6 blocks of 16 a choice; 12 in all
    with pytest.raises(PoolTooSmall):
        asyncio.run(_served(_door(published_llm), Submission("s", [[5, 6, 7]], big, n=3)))
    with pytest.raises(UnknownModel):
        _door(published_llm).model("gpt-4")
    assert published_llm.engine.ledger.reserved_blocks == 0


@pytest.fixture(scope="module")
def reserving_llm(tiny_llama_dir):
    """Every promise set aside whole (``--admission reserve``): a full pool is plain."""
    return LLM(str(tiny_llama_dir), max_model_len=96, max_num_seqs=4, device="cpu",
               num_gpu_blocks_override=12, admission="reserve")


def test_a_full_pool_refuses_before_tokenizing_and_holds_nothing(reserving_llm):
    """The early refusal comes before the tokenizer; a refusal of a later prompt gives
    back the blocks of the ones admitted before it (they were running)."""
    engine = reserving_llm.engine
    door = _door(reserving_llm, max_queue_len=0)
    encoded = []
    real_encode = engine.tokenizer.encode

    def counted(*args, **kwargs):
        encoded.append(args)
        return real_encode(*args, **kwargs)

    async def scenario() -> None:
        await door.start(warm=False)
        engine.tokenizer.encode = counted
        try:
            hog = await door.submit(Submission("hog", [[5] * 15], SamplingParams(
                temperature=0, max_tokens=33, ignore_eos=True), n=4))  # 3 blocks x 4 = 12
            try:
                with pytest.raises(KVCacheFull):
                    await door.submit(Submission("late", ["A ledger"], SamplingParams(
                        temperature=0, max_tokens=4), tenant=Tenant("k", "key-0")))
                assert not encoded  # refused on its bound, never tokenized
            finally:
                await hog.aclose()
            filler = await door.submit(Submission("filler", [[5] * 15], SamplingParams(
                temperature=0, max_tokens=33, ignore_eos=True), n=3))  # 9 of the 12 blocks
            try:  # its first prompt is admitted (and runs), its second is refused
                with pytest.raises(KVCacheFull):
                    await door.submit(Submission("pair", [[6, 7], [8] * 40], SamplingParams(
                        temperature=0, max_tokens=20)))
                assert door.running == 1  # the filler alone: the pair's first is back
            finally:
                await filler.aclose()
            for _ in range(500):  # the aborted choices' blocks come back at the next step
                if engine.ledger.reserved_blocks == 0:
                    break
                await asyncio.sleep(0.01)
            assert door.running == 0 and engine.ledger.reserved_blocks == 0
        finally:
            del engine.tokenizer.encode
            await door.stop()

    asyncio.run(scenario())


def test_the_server_holds_nothing_of_the_engine_but_its_door():
    """Beside the import contract (server/ imports nothing of core/, admission/, kv/),
    no server module reaches the engine object it is handed: past ``ServerState.attach``
    (which builds the door around it) and the start's loading, the server reads the
    engine only through the door and its ``Served`` view (frontend/served.py)."""
    import re
    from pathlib import Path

    import kvledger.engine.server as server
    from kvledger.engine.server.state import ServerState

    assert not hasattr(ServerState, "engine")
    reaches = re.compile(r"\bengine\.(ledger|loras|scheduler|runner|stall_watch|plan|config"
                         r"|check_prompt|max_model_len|tokenizer)\b|\b(state|door)\.engine\b")
    allowed = {("state.py", "attach")}  # where the door is built around the engine
    found = []
    for path in Path(server.__file__).parent.rglob("*.py"):
        function = ""
        for line in path.read_text().splitlines():
            defined = re.match(r"\s*(?:async\s+)?def (\w+)", line)
            if defined and not line.startswith("        "):
                function = defined.group(1)
            if reaches.search(line) and (path.name, function) not in allowed:
                found.append(f"{path.name}:{function}: {line.strip()}")
    assert not found, found
