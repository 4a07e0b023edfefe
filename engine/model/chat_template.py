"""A model's chat templates, read where transformers reads them and rendered as it renders
them (jinja2, sandboxed), with vLLM's server and request options.

Where a checkpoint keeps its templates (transformers 5 precedence: the files first):
``chat_template.jinja`` (the default), ``additional_chat_templates/NAME.jinja`` (named
ones), else
``tokenizer_config.json``'s ``chat_template`` (a string, or a list of ``{name,
template}``). With several, a request with tools takes ``tool_use`` when there is one,
else ``default``.

What a render takes beyond the messages: ``add_generation_prompt``,
``continue_final_message`` (the last message left open for the model to continue, as
transformers cuts it), ``tools`` and a request's ``chat_template_kwargs``, kept to the
variables the template reads (vLLM's rule; a name the server sets itself is refused).
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from kvledger.engine.checkpoint.files import CHAT_TEMPLATE_DIR, CHAT_TEMPLATE_FILE, TEMPLATE_SUFFIX
from kvledger.engine.errors import BadInput, shown
from kvledger.engine.model import template_bounds


class ReservedKwargs(BadInput):
    """A request's ``chat_template_kwargs`` names a variable its own fields set."""


DEFAULT, TOOL_USE = "default", "tool_use"
# How a message's content reaches the template (--chat-template-content-format)
AUTO, STRING, OPENAI = "auto", "string", "openai"
# Set by the server from the request itself: a chat_template_kwargs entry may not.
RESERVED_KWARGS = frozenset({"messages", "tools", "add_generation_prompt",
                             "continue_final_message", "bos_token", "eos_token",
                             "chat_template", "tokenize"})
MAX_TEMPLATE_BYTES = 1 << 20  # a template larger than this is refused, a file or a request's


def read_templates(model_dir: Path, config_value: Any) -> dict[str, str]:
    """The checkpoint's templates by name (``default``, ``tool_use``, ...), files first as
    transformers 5 reads them; empty when it has none. BadInput for an unreadable file or
    a malformed ``tokenizer_config.json`` entry."""
    templates = _config_templates(model_dir, config_value)
    files = {}
    if (model_dir / CHAT_TEMPLATE_FILE).is_file():
        files[DEFAULT] = _read(model_dir / CHAT_TEMPLATE_FILE)
    if (model_dir / CHAT_TEMPLATE_DIR).is_dir():
        for path in sorted((model_dir / CHAT_TEMPLATE_DIR).glob("*" + TEMPLATE_SUFFIX)):
            files[path.stem] = _read(path)
    return files or templates


def template_argument(value: str) -> str:
    """vLLM's ``--chat-template``: a file's path (read), else the template itself when it
    looks like one (it holds ``{``, ``}`` or a newline); BadInput for a path that does not
    exist."""
    path = Path(value)
    # os.path's: False, not OSError, for an inline template longer than a file name.
    if os.path.isfile(path):
        return _read(path)
    if any(c in value for c in "{}\n"):
        return value
    raise BadInput(f"--chat-template {shown(value)}: no such file, and not a jinja2 template "
                   f"either (it holds no '{{', '}}' or newline)")


def checked_template(value: str) -> str:
    """``--chat-template``'s (and ``LLM(chat_template=...)``'s) template, read and compiled
    now: a bad one is BadInput before anything loads."""
    source = template_argument(value)
    try:
        compiled(source)
    except BadInput as exc:
        raise BadInput(f"--chat-template: {exc}") from None
    return source


def pick(templates: dict[str, str], tools: bool) -> str | None:
    """The template a chat renders with: the only one, else ``tool_use`` for a request with
    tools (when there is one), else ``default``; None when there is none."""
    if not templates:
        return None
    if len(templates) == 1:
        return next(iter(templates.values()))
    if tools and TOOL_USE in templates:
        return templates[TOOL_USE]
    if DEFAULT not in templates:
        raise BadInput(f"the model has several chat templates ({', '.join(sorted(templates))}) "
                       f"and none named {DEFAULT!r}; pass --chat-template")
    return templates[DEFAULT]


def render(source: str, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
           tools: list[dict[str, Any]] | None, bos_token: str, eos_token: str,
           kwargs: dict[str, Any] | None = None, continue_final_message: bool = False,
           content: str = AUTO, special_tokens: dict[str, Any] | None = None,
           untrusted: bool = False) -> str:
    """``messages`` as the prompt text ``source`` makes of them, each message's content
    (a string, or a list of text parts) in the ``content`` format (``content_format``),
    the tokenizer's ``special_tokens`` (``pad_token``...) as variables, as transformers
    gives them. ``kwargs``: a request's ``chat_template_kwargs`` (over the special
    tokens, as transformers merges them), those the template does not read dropped (vLLM
    drops them too), a reserved name refused. ``untrusted``: a request's own template,
    rendered within ``template_bounds``. BadInput when the template fails or raises."""
    template, variables = compiled(source, untrusted)
    openai = (content_format(source) if content == AUTO else content) == OPENAI
    messages = [{**m, "content": _content(m.get("content"), openai)} for m in messages]
    extra = dict(kwargs or {})
    reserved = sorted(RESERVED_KWARGS & extra.keys())
    if reserved:
        raise ReservedKwargs(f"chat_template_kwargs may not set {', '.join(reserved)} (the "
                             f"request's own fields set them)")
    extra = {k: v for k, v in extra.items() if k in variables}
    context = {**(special_tokens or {}), **extra, "messages": messages,
               "add_generation_prompt": add_generation_prompt, "tools": tools,
               "bos_token": bos_token, "eos_token": eos_token}
    try:
        text = (template_bounds.render_bounded(template, context) if untrusted
                else template.render(context))
    except BadInput:
        raise
    except Exception as exc:  # jinja2's and the template's own errors alike
        raise BadInput(f"chat template failed: {exc}") from None
    return _open_final(text, messages) if continue_final_message else text


@lru_cache(maxsize=32)
def content_format(source: str) -> str:
    """How ``source`` reads a message's content, as vLLM's ``auto`` tells: ``openai`` (a list
    of ``{"type": "text", "text": ...}`` parts) when it loops over a message's content
    (``{% for part in message['content'] %}``, filtered or not), else ``string``."""
    from jinja2 import Environment, TemplateError, nodes

    try:
        tree = Environment().parse(source)
    except TemplateError:
        return STRING  # ``compiled`` says why
    for loop in tree.find_all(nodes.For):
        looped = loop.iter
        while isinstance(looped, nodes.Filter | nodes.Test) and looped.node is not None:
            looped = looped.node
        if (isinstance(looped, nodes.Getattr) and looped.attr == "content") or (
                isinstance(looped, nodes.Getitem) and isinstance(looped.arg, nodes.Const)
                and looped.arg.value == "content"):
            return OPENAI
    return STRING


def _content(content: Any, openai: bool) -> Any:
    """A message's content as the template reads it: text parts joined by newlines (as
    vLLM joins them), or every content a list of text parts. Anything else (an offline
    caller's own shapes) reaches the template as given."""
    if openai:
        return [{"type": "text", "text": content}] if isinstance(content, str) else content
    if isinstance(content, list) and all(
            isinstance(part, dict) and part.get("type") == "text"
            and isinstance(part.get("text"), str) for part in content):
        return "\n".join(part["text"] for part in content)
    return content


@lru_cache(maxsize=32)
def compiled(source: str, untrusted: bool = False):
    """``source`` compiled in jinja2's immutable sandbox with Hugging Face's globals, and
    the names it reads; cached (a request's own template is compiled once), a request's
    (``untrusted``) in ``template_bounds``' sandbox. BadInput, one line, when it is not
    valid jinja2."""
    from jinja2 import TemplateError, meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if len(source.encode()) > MAX_TEMPLATE_BYTES:
        raise BadInput(f"the chat template is larger than {MAX_TEMPLATE_BYTES} bytes")
    sandbox = (template_bounds.untrusted_environment if untrusted
               else ImmutableSandboxedEnvironment)
    env = sandbox(trim_blocks=True, lstrip_blocks=True,
                  extensions=["jinja2.ext.loopcontrols", _generation_tag()])
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = _strftime_now  # Llama 3.x templates date prompts
    env.filters["tojson"] = _tojson  # Hugging Face's: tool schemas render as plain JSON
    try:
        return env.from_string(source), frozenset(meta.find_undeclared_variables(env.parse(source)))
    except TemplateError as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise BadInput(f"the chat template is not a valid jinja2 template: {message}") from None


@lru_cache(maxsize=1)
def _generation_tag():
    """transformers' ``{% generation %}...{% endgeneration %}`` (its ``AssistantTracker``:
    templates written for assistant-token masks mark the assistant's turns with it): the
    body renders as it is; what it marks matters only to training."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return GenerationTag


def _open_final(text: str, messages: list[dict[str, Any]]) -> str:
    """``text`` cut right after the last message's content, as transformers'
    ``continue_final_message`` cuts it: what the template closes the turn with is gone."""
    content = messages[-1].get("content") if messages else None
    if isinstance(content, list):  # its last text part, as transformers takes it
        content = content[-1]["text"] if content else ""
    final = content.strip() if isinstance(content, str) else ""
    at = text.rfind(final)  # an empty final message: nothing cut, as transformers
    if at < 0:
        raise BadInput("continue_final_message: the last message's content does not appear "
                       "in the chat as the template renders it")
    return text[:at + len(final)]


def _config_templates(model_dir: Path, value: Any) -> dict[str, str]:
    where = f"{model_dir / 'tokenizer_config.json'}: chat_template"
    if isinstance(value, list):
        if not all(isinstance(t, dict) and isinstance(t.get("template"), str) for t in value):
            raise BadInput(f"{where} must be a string or a list of {{name, template}} objects")
        return {str(t.get("name") or DEFAULT): t["template"] for t in value}
    if value is not None and not isinstance(value, str):
        raise BadInput(f"{where} must be a string, got {type(value).__name__}")
    return {DEFAULT: value} if value else {}


def _read(path: Path) -> str:
    try:
        if path.stat().st_size > MAX_TEMPLATE_BYTES:
            raise BadInput(f"{path}: a chat template larger than {MAX_TEMPLATE_BYTES} bytes")
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"{path}: cannot read the chat template ({exc})") from None


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
