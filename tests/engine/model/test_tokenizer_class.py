"""A SentencePiece-style tokenizer.json (Llama 2's shape: byte fallback, a normalizer
that prepends the word boundary) read as transformers 5's ``AutoTokenizer`` reads it
for the class and model type the folder names: the reference vLLM 0.32 tokenizes with.
Llama 2 and its fine-tunes name ``LlamaTokenizer``, which transformers 5 rebuilds around
the file's vocabulary (``model/tokenizer_class.py``); others are read as written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from kvledger.engine.model.tokenizer import Tokenizer

TEXTS = ["Hello", " Hello", "<s>Hello", "Hello</s> world", "a<s>b", "  two  spaces",
         "naïve café €", "emoji 🐱 cat", "\n\nnew lines\n", "The<s> quick</s>brown", "x"]
CORPUS = ["Hello world, this is a test of the tokenizer.", "Once upon a time there was a cat.",
          "The quick brown fox jumps over the lazy dog."] * 20


@pytest.fixture(scope="module")
def sp_tokenizer() -> HFTokenizer:
    """A BPE with byte fallback and the 256 byte tokens, as Llama 2's file is shaped."""
    tok = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256))]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, show_progress=False))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok


def _folder(root: Path, tok: HFTokenizer, tokenizer_class: str, model_type: str,
            **config) -> Path:
    folder = root / f"{model_type}-{tokenizer_class}-{len(list(root.iterdir()))}"
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(folder)
    path = folder / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()),
                                "tokenizer_class": tokenizer_class, **config}))
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    return folder


@pytest.mark.parametrize("config", [{}, {"legacy": True}, {"legacy": False},
                                    {"add_prefix_space": False}])
@pytest.mark.parametrize(("tokenizer_class", "model_type"), [
    ("LlamaTokenizer", "llama"), ("LlamaTokenizerFast", "llama"),  # rebuilt
    ("LlamaTokenizer", "mistral"), ("PreTrainedTokenizerFast", "llama"),  # as written
])
def test_ids_and_text_are_transformers_5s(sp_tokenizer, tmp_path, tokenizer_class,
                                          model_type, config):
    folder = _folder(tmp_path, sp_tokenizer, tokenizer_class, model_type, **config)
    reference, ours = AutoTokenizer.from_pretrained(folder), Tokenizer(folder)
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, special) == reference.encode(text, add_special_tokens=special), text
        ids = reference.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip) == reference.decode(ids, skip_special_tokens=skip)


def test_llama_2s_file_after_a_special_token(sp_tokenizer, tmp_path):
    """Before: the file's normalizer put a word boundary after ``<s>`` (vLLM: none), and a
    chat prompt grew by a token after each special one."""
    folder = _folder(tmp_path, sp_tokenizer, "LlamaTokenizer", "llama")
    ours = Tokenizer(folder)
    first = ours.encode("<s>Hello", add_special_tokens=False)[1]
    assert not ours.id_to_token(first).startswith("▁")
    as_written = sp_tokenizer.encode("<s>Hello", add_special_tokens=False).ids
    assert ours.encode("<s>Hello", add_special_tokens=False) != as_written


def test_a_byte_level_file_under_llamas_class_is_read_as_written(tiny_llama_dir, tmp_path):
    """Llama 3 and DeepSeek name LlamaTokenizerFast over a byte-level file."""
    folder = tmp_path / "byte-level"
    folder.mkdir()
    for name in ("tokenizer.json", "config.json"):
        (folder / name).write_bytes((tiny_llama_dir / name).read_bytes())
    config = json.loads((tiny_llama_dir / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {**config, "tokenizer_class": "LlamaTokenizerFast"}))
    reference, ours = AutoTokenizer.from_pretrained(folder), Tokenizer(folder)
    for text in TEXTS:
        assert ours.encode(text) == reference.encode(text)


@pytest.mark.parametrize("trailing_specials", [0, 4, 5, 12])
def test_streamed_text_after_a_prompt_ending_in_special_tokens(sp_tokenizer, tmp_path,
                                                                trailing_specials):
    """A decoder that strips the text's first space (SentencePiece's) strips the prompt's,
    not the answer's, however many special tokens end the prompt: the answer is what the
    whole decode adds to the prompt's, as vLLM's detokenizer (which reads the whole prompt)
    gives it. Before, five special tokens at the prompt's end lost the answer's space."""
    folder = _folder(tmp_path, sp_tokenizer, "PreTrainedTokenizerFast", "llama")
    reference, ours = AutoTokenizer.from_pretrained(folder), Tokenizer(folder)
    eos = reference.convert_tokens_to_ids("</s>")
    prompt = reference.encode("Once upon a time", add_special_tokens=False) + [eos] * trailing_specials
    output = reference.encode(" Hello world", add_special_tokens=False)
    detokenizer = ours.detokenizer(prompt)
    streamed = "".join(detokenizer.add(token_id) for token_id in output)
    whole = reference.decode(prompt + output, skip_special_tokens=True)
    assert streamed == whole[len(reference.decode(prompt, skip_special_tokens=True)):]
    assert streamed.startswith(" ")
