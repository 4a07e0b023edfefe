"""A tokenizer.json as transformers 5 reads it for the class tokenizer_config.json names,
which is how vLLM 0.32 reads it (``AutoTokenizer``): for ``LlamaTokenizer`` that is not
the file as written.

transformers 5 builds a SentencePiece-style ``LlamaTokenizer`` (Llama 2, TinyLlama,
Vicuna and their fine-tunes) from the file's vocabulary and merges alone, with its own
pieces around them: no normalizer, a ``Metaspace`` pre-tokenizer that puts the word
boundary ``▁`` before the text only at its start (``legacy: false``, the default) or
after every special token too (``legacy: true``), never with ``add_prefix_space: false``,
and the matching decoder. The files those checkpoints ship prepend ``▁`` in a normalizer,
after every special token: read as written, ``<s>Hello`` gave ``▁Hello`` where vLLM
gives ``Hello``, and a chat prompt three tokens more. A byte-level file under that class
(Llama 3, DeepSeek) and a Mistral or Mixtral model (transformers reads those files as
written) are left as they are.
"""

from __future__ import annotations

from typing import Any

LLAMA_CLASS = "LlamaTokenizer"
# Model types whose files transformers 5 reads as written whatever class they name.
AS_WRITTEN_MODEL_TYPES = frozenset({"mistral", "mixtral"})


def rebuilds(tokenizer_json: str, tokenizer_config: dict[str, Any], model_type: str | None) -> bool:
    """Whether transformers 5 rebuilds this file's pieces (module docstring)."""
    named = tokenizer_config.get("tokenizer_class")
    return (isinstance(named, str) and named.removesuffix("Fast") == LLAMA_CLASS
            and model_type not in AS_WRITTEN_MODEL_TYPES
            and '"ByteLevel"' not in tokenizer_json)


def as_transformers_reads(tok: Any, tokenizer_json: str, tokenizer_config: dict[str, Any],
                          model_type: str | None) -> None:
    """Give ``tok`` (a ``tokenizers.Tokenizer`` of ``tokenizer_json``) the pieces
    transformers 5 gives it, where it rebuilds them; its vocabulary, merges, added tokens
    and post-processor stay the file's."""
    from tokenizers import decoders, pre_tokenizers
    from tokenizers.models import BPE

    if not rebuilds(tokenizer_json, tokenizer_config, model_type) or not isinstance(tok.model, BPE):
        return
    prefix = tokenizer_config.get("add_prefix_space")
    prefix = True if prefix is None else bool(prefix)
    legacy = bool(tokenizer_config.get("legacy", False))
    scheme = ("always" if legacy else "first") if prefix else "never"
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme,
                                                 split=False)
    pieces = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        pieces.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(pieces)
    tok.model.byte_fallback = True
    tok.model.fuse_unk = True
