"""Byte-level BPE tokenizers trained here: the built-in models' (``builtin``) and
bench/grammar_mask.py's 32k one."""

from __future__ import annotations

from collections.abc import Iterable


def train_byte_level_bpe(lines: Iterable[str], vocab_size: int, special_tokens: list[str]):
    """A byte-level BPE ``tokenizers.Tokenizer`` of ``vocab_size`` tokens trained on the
    strings ``lines``, ``special_tokens`` first; the same tokens on every run."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(lines, trainer)
    return tokenizer
