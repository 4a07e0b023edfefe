"""Text streamed as a sequence's tokens arrive (``IncrementalDetokenizer``), as vLLM's
detokenizer streams it: never a multi-byte character split, the cost per token not
growing with the output."""

from __future__ import annotations

from typing import Protocol


class Decoder(Protocol):
    """What a detokenizer reads of its tokenizer (``tokenizer.Tokenizer``)."""

    added_texts: dict[int, str]  # every added token's text by id
    special_ids: frozenset[int]  # those a decode that skips special tokens drops

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Streams text as tokens arrive, never splitting a multi-byte character.

    Decodes a short window (a few tokens of context + the new ones) each step, as vLLM
    does, so the cost per token does not grow with the length of the output. Special
    tokens are dropped, but for ``kept_special_ids``, whose text goes in where they come
    (the text around them decodes as if they were not there, but for ids still waiting
    for the rest of a character: they are written as they stand before the marker, as a
    decode of the whole output writes them, never after it), and all of them with
    ``skip_special_tokens`` False (vLLM's request field). With
    ``spaces_between_special_tokens`` False too, an added token right after another is
    its bare text, as vLLM's fast detokenizer gives it: a decoder that spaces tokens apart
    (WordPiece's) spaces it from the text before them, never from each other.
    """

    _CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: Decoder, prompt_token_ids: list[int],
                 kept_special_ids: frozenset[int] = frozenset(),
                 skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._kept = kept_special_ids
        self._skip = skip_special_tokens
        # Added tokens' texts, when they are not to be spaced apart (else None)
        self._bare = (None if skip_special_tokens or spaces_between_special_tokens
                      else tokenizer.added_texts)
        self._last_added = False
        self._ids: list[int] = self._context(prompt_token_ids, tokenizer.special_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # The text so far as its pieces, joined when read (``text``): a step's += would copy
        # the whole text, each step.
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """All the text streamed so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def _context(self, prompt_token_ids: list[int], special_ids: frozenset[int]) -> list[int]:
        """The prompt's last ``_CONTEXT_TOKENS`` tokens that decode to text: skipping
        special tokens, those before the prompt's trailing ones (a chat's ``<|im_end|>``,
        ``<|im_start|>``...), so a decoder that strips the text's first space (SentencePiece's)
        strips the prompt's, not the answer's, as vLLM's detokenizer, which reads the whole
        prompt, does."""
        if not self._skip:
            return list(prompt_token_ids[-self._CONTEXT_TOKENS:])
        context: list[int] = []
        for token_id in reversed(prompt_token_ids):
            if token_id not in special_ids:
                context.append(token_id)
                if len(context) == self._CONTEXT_TOKENS:
                    break
        return context[::-1]

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty)."""
        if token_id in self._kept:
            kept = self._flushed() + self._tokenizer.decode([token_id],
                                                            skip_special_tokens=False)
            self._pieces.append(kept)
            return kept
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset:self._read_offset], self._skip)
        full = decode(self._ids[self._prefix_offset:], self._skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence, or a special token: wait
        new_text = full[len(prefix):]
        if self._bare is not None:
            added = self._bare.get(token_id)
            if added is not None and self._last_added:
                new_text = added
            self._last_added = added is not None
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._pieces.append(new_text)
        return new_text

    def _flushed(self) -> str:
        """The text of the ids waiting for the rest of a character, as it stands (U+FFFD),
        those ids then let go: a marker comes between them and what follows, so nothing
        after it completes them."""
        if self._read_offset == len(self._ids):
            return ""
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset:self._read_offset], self._skip)
        full = decode(self._ids[self._prefix_offset:], self._skip)
        del self._ids[self._read_offset:]
        return full[len(prefix):]
