"""Tokenizer of a checkpoint directory: ``tokenizer.json`` via the ``tokenizers`` library,
its chat templates (``chat_template``: where transformers reads them, rendered with jinja2),
and what ``generation_config.json`` says of generating (EOS ids, sampling defaults)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvledger.engine import json_text
from kvledger.engine.checkpoint.files import (
    CONFIG_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
)
from kvledger.engine.errors import BadInput, clip
from kvledger.engine.model import chat_template, tokenizer_class
from kvledger.engine.model.detokenizer import IncrementalDetokenizer
from kvledger.engine.model.generation_config import (
    AUTO,
    max_tokens_cap,
    sampling_defaults,
    stop_ids,
)


class Tokenizer:
    """``encode``/``decode``, ``apply_chat_template`` and the set of EOS token ids."""

    def __init__(self, model_dir: str | Path, generation_config: str = AUTO,
                 tokenizer_dir: str | Path | None = None,
                 generation_overrides: dict[str, Any] | None = None) -> None:
        """The tokenizer files (tokenizer.json, tokenizer_config.json, chat templates) from
        ``tokenizer_dir`` (vLLM's ``--tokenizer``; default the model's folder), what
        generating needs (generation_config.json, config.json) from ``model_dir``, with
        ``generation_overrides`` (``--override-generation-config``) over its defaults."""
        from tokenizers import Tokenizer as HFTokenizer

        model_dir = Path(model_dir)
        files = Path(tokenizer_dir) if tokenizer_dir is not None else model_dir
        path = files / TOKENIZER_FILE
        if not os.path.isfile(path):  # False for a name too long, as for none
            raise BadInput(f"{clip(str(files))}: no {TOKENIZER_FILE} (kvledger needs a fast "
                           "tokenizer file; --tokenizer DIR reads one from another folder)")
        try:
            text = path.read_text(encoding="utf-8")
            self._tok = HFTokenizer.from_str(text)
        except Exception as exc:  # the library raises a bare Exception on bad files
            raise BadInput(f"{path}: cannot read tokenizer: {exc}") from None
        self.tokenizer_config = _read_json(files / TOKENIZER_CONFIG_FILE)
        # As transformers 5 reads it for the class it names (vLLM's tokenizer)
        model_type = next((config.get("model_type") for folder in (files, model_dir)
                           if (config := _read_json(folder / CONFIG_FILE))), None)
        tokenizer_class.as_transformers_reads(self._tok, text, self.tokenizer_config, model_type)
        # The batch call releases the GIL while the Rust code runs; ``encode`` holds it
        # throughout (seconds for a 4 MiB prompt), which would stall the server's event
        # loop even from a worker thread. ``_fast`` skips the offsets nobody reads.
        self._encode_batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        # Every added token's text by id, special or not
        added = self._tok.get_added_tokens_decoder()
        self.added_texts: dict[int, str] = {token_id: token.content
                                            for token_id, token in added.items()}
        # The ids a decode that skips special tokens drops
        self.special_ids = frozenset(token_id for token_id, token in added.items()
                                     if token.special)
        self.bos_token = _token_text(self.tokenizer_config.get("bos_token"))
        self.eos_token = _token_text(self.tokenizer_config.get("eos_token"))
        # What a chat template reads of them (transformers' special_tokens_map)
        self.special_tokens = special_tokens_map(self.tokenizer_config)
        self.chat_templates = chat_template.read_templates(
            files, self.tokenizer_config.get("chat_template"))
        self.eos_token_ids: set[int] = set()
        if self.eos_token is not None and self.token_to_id(self.eos_token) is not None:
            self.eos_token_ids.add(self.token_to_id(self.eos_token))
        # The model's published sampling defaults (``generation_config``), for requests
        # that leave them unset; ``generation_config`` is --generation-config; and the cap
        # on every request a folder's or the override's max_new_tokens sets.
        self.sampling_defaults = sampling_defaults(model_dir, generation_config,
                                                   generation_overrides)
        self.max_tokens_cap = max_tokens_cap(self.sampling_defaults, generation_config,
                                             generation_overrides)
        self.eos_token_ids.update(stop_ids(model_dir, generation_config))
        for name, source in self.chat_templates.items():  # a bad one fails here, at load
            _check_template(f"{files}: chat template {name!r}", source)

    @property
    def chat_template(self) -> str | None:
        """The template a chat without tools renders with (None: the model has none)."""
        return chat_template.pick(self.chat_templates, tools=False)

    def use_chat_template(self, source: str, where: str = "--chat-template") -> None:
        """Render every chat with ``source`` instead of the checkpoint's (vLLM's
        ``--chat-template``); BadInput when it is not valid jinja2."""
        _check_template(where, source)
        self.chat_templates = {chat_template.DEFAULT: source}

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def to_str(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (what grammar libraries load)."""
        return self._tok.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary's string for ``token_id`` (byte-level BPE's ``Ġ`` and all, as
        transformers' ``convert_ids_to_tokens``); None for an id past it."""
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, *,
                            template: str | None = None,
                            kwargs: dict[str, Any] | None = None,
                            continue_final_message: bool = False,
                            content: str = "auto") -> str:
        """Render the chat as the model's prompt text. The template usually emits the BOS
        token itself, so encode the result with ``add_special_tokens=False``. ``tools``:
        OpenAI's tool objects, as Hugging Face templates take them (None: no tools);
        ``template``: a request's own (else the model's); ``kwargs``: its
        ``chat_template_kwargs``; ``continue_final_message``: the last message left open;
        ``content``: how the template gets a message's content (``chat_template.render``)."""
        source = template or chat_template.pick(self.chat_templates, tools=bool(tools))
        if source is None:
            # vLLM's sentence first: clients match on it to tell a base model
            raise BadInput("As of transformers v4.44, default chat template is no longer "
                           "allowed, so you must provide a chat template if the tokenizer "
                           "does not define one. This model has none (chat_template.jinja or "
                           "tokenizer_config.json's chat_template); pass --chat-template, or "
                           "use the completions API")
        return chat_template.render(source, messages, add_generation_prompt=add_generation_prompt,
                                    tools=tools, bos_token=self.bos_token or "",
                                    eos_token=self.eos_token or "", kwargs=kwargs,
                                    special_tokens=self.special_tokens,
                                    continue_final_message=continue_final_message,
                                    content=content, untrusted=template is not None)

    def special_token_id(self, text: str) -> int | None:
        """The id of the special token ``text`` (one decoding drops), else None."""
        token_id = self._tok.token_to_id(text)
        if token_id is None or self.decode([token_id]) != "":
            return None
        return token_id if self.decode([token_id], skip_special_tokens=False) == text else None

    def added_token_id(self, text: str) -> int | None:
        """The id of the added token ``text``, special or not (Qwen's and Hermes'
        ``<tool_call>`` is added with ``"special": false``), else None."""
        token_id = self._tok.token_to_id(text)
        return token_id if token_id is not None and self.added_texts.get(token_id) == text \
            else None

    def detokenizer(self, prompt_token_ids: list[int],
                    kept_special_ids: frozenset[int] = frozenset(),
                    skip_special_tokens: bool = True,
                    spaces_between_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_token_ids, kept_special_ids,
                                      skip_special_tokens, spaces_between_special_tokens)



def _check_template(where: str, source: str) -> None:
    try:
        chat_template.compiled(source)
    except BadInput as exc:
        raise BadInput(f"{where}: {exc}") from None


SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")


def special_tokens_map(config: dict[str, Any]) -> dict[str, Any]:
    """The special tokens tokenizer_config.json names, by name (``pad_token``: its text):
    what transformers 5's ``special_tokens_map`` gives a chat template (its extra special
    tokens, ``additional_special_tokens`` before, are not among them)."""
    return {name: text for name in SPECIAL_TOKEN_NAMES
            if (text := _token_text(config.get(name))) is not None}


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json_text.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BadInput(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadInput(f"{path}: must be a JSON object, got {type(data).__name__}")
    return data


def _token_text(token: Any) -> str | None:
    if isinstance(token, dict):  # {"content": "<s>", "__type": "AddedToken", ...}
        token = token.get("content")
    return token if isinstance(token, str) else None
