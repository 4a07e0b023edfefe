"""vLLM's dotted arguments: a JSON-valued flag given key by key, as vLLM 0.32's
``FlexibleArgumentParser.parse_args`` (``vllm/utils/argparse_utils.py``) reads them.

``--kv-events-config.enable_kv_cache_events true`` (or ``...=true``) is
``--kv-events-config '{"enable_kv_cache_events": true}'``; ``--flag.a.b 1`` nests
(``{"a": {"b": 1}}``); ``--flag.key+ x,y`` (or ``+=x,y``) adds the comma-separated strings to
a list. A value is JSON where it parses as JSON, else a count as vLLM reads one (``80g``,
``vllm_numbers.py``), else the text itself. Every dotted argument of a flag (``-cc`` is a
flag of its own, as in vLLM) is merged into one object, lists joined, and that object is
given to the flag after every other argument, so it replaces a whole JSON given to the
same flag (argparse keeps the last value), as in vLLM. The flag then reads, checks or
refuses the object as it would the JSON: a refused flag's line is the same either way.
"""

from __future__ import annotations

import json
import re
from typing import Any

from kvledger.engine import json_text
from kvledger.engine.errors import BadInput, clip
from kvledger.engine.settings.vllm_numbers import human_readable_int

# A flag's name (one or two dashes, then a letter: never a negative number such as -0.5),
# then its keys. vLLM takes any argument that starts with '-' and holds a '.'.
_DOTTED = re.compile(r"(-{1,2}[A-Za-z][A-Za-z0-9_-]*)((?:\.[^.=]+)+)")


def merge_dotted(argv: list[str]) -> list[str]:
    """``argv`` with each flag's dotted arguments replaced by one ``FLAG JSON`` at the end."""
    out: list[str] = []
    merged: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        append = name.endswith("+")  # --flag.key+ x,y: add to a list
        match = _DOTTED.fullmatch(name.removesuffix("+")) if arg.startswith("-") else None
        if match is None:
            out.append(arg)
            i += 1
            continue
        if not eq:
            if i + 1 >= len(argv):
                raise BadInput(f"{clip(name)} needs a value")
            value = argv[i + 1]
            i += 1
        i += 1
        flag, keys = match.groups()
        parsed = json.dumps(value.split(",")) if append else value
        nested: Any = _value(parsed)
        for key in reversed(keys[1:].split(".")):
            nested = {key: nested}
        _update(merged.setdefault(flag, {}), nested)
    for flag, value in merged.items():
        out += [flag, json.dumps(value)]
    return out


def _value(text: str) -> Any:
    try:
        return json_text.loads(text)
    except ValueError:  # not JSON (nested too deeply included)
        pass
    try:
        return human_readable_int(text)
    except BadInput:
        return text


def _update(into: dict[str, Any], update: dict[str, Any]) -> None:
    """vLLM's ``recursive_dict_update``: objects merge, lists join, a value replaces."""
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _update(into[key], value)
        elif isinstance(value, list) and isinstance(into.get(key), list):
            into[key] += value
        else:
            into[key] = value
