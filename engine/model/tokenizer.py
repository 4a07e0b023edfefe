"""Tokenizer of a checkpoint directory: ``tokenizer.json`` via the ``tokenizers`` library,
the chat template from ``tokenizer_config.json`` rendered with jinja2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvledger.engine import json_text
from kvledger.engine.errors import BadInput


class Tokenizer:
    """``encode``/``decode``, ``apply_chat_template`` and the set of EOS token ids."""

    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise BadInput(f"{model_dir}: no tokenizer.json (kvledger needs a fast tokenizer file)")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception on bad files
            raise BadInput(f"{path}: cannot read tokenizer: {exc}") from None
        # The batch call releases the GIL while the Rust code runs; ``encode`` holds it
        # throughout (seconds for a 4 MiB prompt), which would stall the server's event
        # loop even from a worker thread. ``_fast`` skips the offsets nobody reads.
        self._encode_batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        self.tokenizer_config = _read_json(model_dir / "tokenizer_config.json")
        self.bos_token = _token_text(self.tokenizer_config.get("bos_token"))
        self.eos_token = _token_text(self.tokenizer_config.get("eos_token"))
        self.chat_template = _chat_template(model_dir, self.tokenizer_config.get("chat_template"))
        self.eos_token_ids: set[int] = set()
        if self.eos_token is not None and self.token_to_id(self.eos_token) is not None:
            self.eos_token_ids.add(self.token_to_id(self.eos_token))
        for source in (_read_json(model_dir / "generation_config.json"),
                       _read_json(model_dir / "config.json")):
            eos = source.get("eos_token_id")
            self.eos_token_ids.update([eos] if isinstance(eos, int) else (eos or []))
        self._template = _compile_template(model_dir, self.chat_template)  # bad: fail at load

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

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """Render the chat as the model's prompt text. The template usually emits the BOS
        token itself, so encode the result with ``add_special_tokens=False``. ``tools``:
        OpenAI's tool objects, as Hugging Face templates take them (None: no tools)."""
        if self._template is None:
            raise BadInput("this model has no chat template; use the completions API")
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, bos_token=self.bos_token or "",
                                         eos_token=self.eos_token or "")
        except BadInput:
            raise
        except Exception as exc:
            raise BadInput(f"chat template failed: {exc}") from None

    def special_token_id(self, text: str) -> int | None:
        """The id of the special token ``text`` (one decoding drops), else None."""
        token_id = self._tok.token_to_id(text)
        if token_id is None or self.decode([token_id]) != "":
            return None
        return token_id if self.decode([token_id], skip_special_tokens=False) == text else None

    def detokenizer(self, prompt_token_ids: list[int],
                    kept_special_ids: frozenset[int] = frozenset()) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_token_ids, kept_special_ids)


class IncrementalDetokenizer:
    """Streams text as tokens arrive, never splitting a multi-byte character.

    Decodes a short window (a few tokens of context + the new ones) each step, as vLLM
    does, so the cost per token does not grow with the length of the output. Special
    tokens are dropped, but for ``kept_special_ids``, whose text goes in where they come
    (the text around them decodes as if they were not there).
    """

    _CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 kept_special_ids: frozenset[int] = frozenset()) -> None:
        self._tokenizer = tokenizer
        self._kept = kept_special_ids
        self._ids: list[int] = list(prompt_token_ids[-self._CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty)."""
        if token_id in self._kept:
            kept = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self.text += kept
            return kept
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset:self._read_offset])
        full = decode(self._ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence, or a special token: wait
        new_text = full[len(prefix):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += new_text
        return new_text


def _chat_template(model_dir: Path, value: Any) -> str | None:
    """tokenizer_config.json's ``chat_template``: a string, or a list of named templates
    (``[{"name": "default", "template": ...}, ...]``) of which the default is used."""
    where = f"{model_dir / 'tokenizer_config.json'}: chat_template"
    if isinstance(value, list):
        if not all(isinstance(t, dict) and isinstance(t.get("template"), str) for t in value):
            raise BadInput(f"{where} must be a string or a list of {{name, template}} objects")
        named = {t.get("name"): t["template"] for t in value}
        value = named.get("default") or next(iter(named.values()), None)
    if value is not None and not isinstance(value, str):
        raise BadInput(f"{where} must be a string, got {type(value).__name__}")
    return value or None


def _compile_template(model_dir: Path, source: str | None):
    if source is None:
        return None
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = _strftime_now  # Llama 3.x templates date prompts
    env.filters["tojson"] = _tojson  # Hugging Face's: tool schemas render as plain JSON
    try:
        return env.from_string(source)
    except TemplateError as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise BadInput(f"{model_dir / 'tokenizer_config.json'}: chat_template is not a valid "
                       f"jinja2 template: {message}") from None


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
        return token.get("content")
    return token


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    """Hugging Face's ``tojson`` (jinja2's own escapes ``<``, ``>`` and ``&`` for HTML)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    import datetime

    return datetime.datetime.now().strftime(fmt)


def _raise_template_error(message: str) -> None:
    raise BadInput(f"chat template: {message}")
