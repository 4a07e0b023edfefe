"""``LLM.generate`` and ``LLM.chat`` with vLLM 0.32's arguments, as its offline scripts
pass them: prompt dicts, ``use_tqdm`` (on, off, or a callable), ``priority`` for all,
``tokenization_kwargs``, ``get_default_sampling_params``, and chat's template options."""

from __future__ import annotations

import functools

import pytest

from kvledger.engine import LLM, SamplingParams
from kvledger.engine.errors import BadInput

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
CHAT = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), max_model_len=128, max_num_seqs=4, device="cpu",
               num_gpu_blocks_override=16)


def _ids(outputs) -> list[list[int]]:
    return [list(o.token_ids) for o in outputs]


def test_prompt_dicts_read_as_text_and_ids(llm) -> None:
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode("The river flows")
    plain = llm.generate(["The river flows", ids], GREEDY, use_tqdm=False)
    as_dicts = llm.generate([{"prompt": "The river flows"}, {"prompt_token_ids": ids}],
                            GREEDY, use_tqdm=False)
    assert _ids(as_dicts) == _ids(plain)
    assert as_dicts[0].prompt == "The river flows"
    one = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert _ids(one) == _ids(plain)[1:]
    for bad, words in [({"prompt": "x", "multi_modal_data": {"image": None}}, "text models"),
                       ({"prompt": "x", "prompt_token_ids": [1]}, "exactly one"),
                       ({"text": "x"}, "exactly one")]:
        with pytest.raises(BadInput, match=words):
            llm.generate(bad, GREEDY, use_tqdm=False)


def test_use_tqdm_shows_the_prompts_finished(llm, capsys) -> None:
    llm.generate(["a", "b", "c"], GREEDY)  # vLLM's default: a bar on stderr
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "3/3" in err
    counts = []

    class Bar:
        def __init__(self, total: int, desc: str) -> None:
            counts.append(total)

        def update(self, n: int) -> None:
            counts.append(n)

        def close(self) -> None:
            counts.append("closed")

    llm.generate(["a", "b"], GREEDY, use_tqdm=functools.partial(Bar))
    assert counts == [2, 1, 1, "closed"]
    llm.generate(["a"], GREEDY, use_tqdm=False)
    assert capsys.readouterr().err == ""


def test_priority_for_all_and_tokenization_kwargs(llm) -> None:
    out = llm.generate(["a", "b"], GREEDY, priority=0, use_tqdm=False)
    assert len(out) == 2
    with pytest.raises(BadInput, match="2 prompts but 3 priorities"):
        llm.generate(["a", "b"], GREEDY, priority=[0, 0, 0], use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    bare = llm.generate("The river", GREEDY, use_tqdm=False,
                        tokenization_kwargs={"add_special_tokens": False})
    assert bare[0].prompt_token_ids == tokenizer.encode("The river", add_special_tokens=False)
    with pytest.raises(BadInput, match="only add_special_tokens"):
        llm.generate("x", GREEDY, use_tqdm=False, tokenization_kwargs={"truncation": True})


def test_default_sampling_params_are_the_models(llm) -> None:
    defaults = llm.get_default_sampling_params()
    assert isinstance(defaults, SamplingParams)
    assert defaults == SamplingParams(**llm.get_tokenizer().sampling_defaults)


def test_chat_takes_vllms_template_options(llm) -> None:
    tokenizer = llm.get_tokenizer()
    rendered = tokenizer.apply_chat_template(CHAT)
    out = llm.chat(CHAT, GREEDY, use_tqdm=False)
    assert out[0].prompt == rendered
    assert out[0].prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)
    own = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    out = llm.chat(CHAT, GREEDY, use_tqdm=False, chat_template=own)
    assert out[0].prompt == "[Hello]>"
    out = llm.chat(CHAT, GREEDY, use_tqdm=False, chat_template=own,
                   add_generation_prompt=False)
    assert out[0].prompt == "[Hello]"
    kwargs = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    out = llm.chat(CHAT, GREEDY, use_tqdm=False, chat_template=kwargs,
                   chat_template_kwargs={"greeting": "Hi! "})
    assert out[0].prompt == "Hi! Hello"
    with pytest.raises(BadInput, match="cannot both be true"):
        llm.chat(CHAT, GREEDY, continue_final_message=True)
    with pytest.raises(BadInput, match="chat_template_content_format"):
        llm.chat(CHAT, GREEDY, chat_template_content_format="xml")
