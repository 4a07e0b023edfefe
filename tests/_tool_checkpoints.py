"""Mistral-style tool-calling checkpoints written from the built-in ``tiny-mistral``: its
tokenizer retrained with ``[TOOL_CALLS]`` (and, as v11 tokenizers have, ``[ARGS]``) as
special tokens, so decoding drops them as it drops Mistral's, and a chat template in the
shape of Mistral's own (``[AVAILABLE_TOOLS]``, ``[TOOL_CALLS]``, ``[TOOL_RESULTS]``, and its
refusal of call ids that are not 9 letters and digits)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from kvledger.engine.model.bpe import train_byte_level_bpe
from kvledger.engine.model.builtin import CORPUS, SPECIAL_TOKENS, TOKENIZER_VOCAB

MISTRAL_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] in ['user', 'system'] %}[INST]{{ message['content'] }}[/INST]"
    "{% elif message['role'] == 'assistant' and message.tool_calls %}[TOOL_CALLS]["
    "{% for call in message.tool_calls %}"
    "{% if call.id is not string or call.id | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{% endif %}"
    "{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson }}, \"id\": \"{{ call.id }}\"}"
    "{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}"
    "{% elif message['role'] == 'tool' %}[TOOL_RESULTS]{\"call_id\": "
    "\"{{ message.tool_call_id }}\", \"content\": {{ message['content'] | tojson }}}"
    "[/TOOL_RESULTS]{% endif %}{% endfor %}"
)


def write_mistral_tools(source: Path, out: Path, *, v11: bool) -> Path:
    """``source`` (tiny-mistral) with the Mistral tool tokens and template, in ``out``."""
    from tokenizers import processors

    shutil.copytree(source, out)
    extra = ["[TOOL_CALLS]", "[ARGS]"] if v11 else ["[TOOL_CALLS]"]
    tokenizer = train_byte_level_bpe(CORPUS.read_text().splitlines(), TOKENIZER_VOCAB,
                                     SPECIAL_TOKENS + extra)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    config = json.loads((out / "config.json").read_text())
    assert tokenizer.get_vocab_size() == config["vocab_size"]  # the weights still fit
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = MISTRAL_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return out
