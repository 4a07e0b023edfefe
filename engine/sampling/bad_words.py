"""vLLM's ``bad_words``: words a request must never write. Each word is the token
sequences it is written as (``word_sequences``: alone and after a space, as vLLM tokenizes
it); at every step a sequence whose tokens but the last end the output so far has its last
token taken out of that request's own logits row (``ban``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

NEG_INF = float("-inf")


def word_sequences(encode: Callable[[str], list[int]],
                   words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The token sequences ``words`` are written as: each word's own tokens (its leading
    spaces dropped), and the tokens of it after a space when those are a different word
    of the same length (a tokenizer that marks a word's start, as byte-level BPE's ``Ġ``),
    as vLLM's ``SamplingParams.update_from_tokenizer`` reads them."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(encode(word.lstrip()))
        if not alone:
            continue
        sequences.append(alone)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            sequences.append(spaced)
    return tuple(sequences)


def ban(row: torch.Tensor, sequences: Sequence[Sequence[int]],
        output_ids: Sequence[int]) -> torch.Tensor:
    """``row`` (one request's logits) with the last token of every sequence whose other
    tokens end ``output_ids`` taken out."""
    banned = [seq[-1] for seq in sequences if len(seq) - 1 <= len(output_ids)
              and (len(seq) == 1 or list(output_ids[len(output_ids) - len(seq) + 1:])
                   == list(seq[:-1]))]
    if not banned:
        return row
    ids = torch.tensor(banned, dtype=torch.long, device=row.device)
    return row.index_fill(0, ids, NEG_INF)


def resolved(params: Any, tokenizer: Any) -> Any:
    """``params`` (``SamplingParams``) with its bad words' token sequences found with
    ``tokenizer``; unchanged when it has none, or has them already."""
    if not params.bad_words or params.bad_words_token_ids:
        return params
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)
    return dataclasses.replace(params,
                               bad_words_token_ids=word_sequences(encode, params.bad_words))
