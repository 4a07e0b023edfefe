"""What each of ``kvledger serve``'s own options accepts (``serve_config.py`` declares the
options): the kinds beyond ``kinds.py``'s, and the ``--help`` groups they are shown in."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvledger.engine import json_text
from kvledger.engine.errors import BadInput
from kvledger.engine.settings.config_values import MAX_LOGPROBS
from kvledger.engine.settings.kinds import Kind, size_arg
from kvledger.engine.settings.vllm_flags import PARSERS, RULES, refusal

# The --help groups, in the order they are listed (after the engine's and the machines').
SERVER = "server"
OPENAI_API = "the OpenAI API (vLLM's flags)"


def _port(flag: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise BadInput(f"{flag} must be in 0..65535, got {value}")


def _some_bytes(flag: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadInput(f"{flag} must be at least 1 byte, got {value}")


def tool_call_parser(name: str) -> str:
    """One of ``PARSERS``; any other is refused by name as plan refuses it."""
    if name not in PARSERS:
        raise BadInput(refusal("--tool-call-parser", [name], RULES["--tool-call-parser"]))
    return name


def _too_many_logprobs(flag: str, given: Any) -> BadInput:
    return BadInput(f"{flag} {given}: kvledger reports at most {MAX_LOGPROBS} logprobs per "
                    f"token (0-{MAX_LOGPROBS})")


def max_logprobs(text: str) -> int:
    """--max-logprobs: 0..MAX_LOGPROBS; vLLM's -1 (the vocabulary) is refused by name."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 0 <= value <= MAX_LOGPROBS:
        raise _too_many_logprobs("--max-logprobs", text)
    return value


def _logprobs(flag: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
        raise _too_many_logprobs(flag, value)


def json_object(text: str) -> dict:
    """argparse type for a JSON object."""
    try:
        value = json_text.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def json_strings(text: str) -> tuple[str, ...]:
    """argparse type for a JSON list of strings (vLLM's ``--allowed-origins '["*"]'``)."""
    try:
        value = json_text.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r} "
                                         f"({exc})") from None
    if not (isinstance(value, list) and all(isinstance(v, str) and v for v in value)):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return tuple(value)


def _strings(flag: str, value: Any) -> None:
    if not (isinstance(value, tuple | list) and all(isinstance(v, str) and v for v in value)):
        raise BadInput(f"{flag} must be a list of strings, got {value!r}")


def _object(flag: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise BadInput(f"{flag} must be a JSON object, got {value!r}")


# A port: 0 on the command line is any free one; the CRD's spec.port starts at 1 (a Service
# needs a real one: operator/api/setting_schema.py types the domain).
PORT = Kind("port", parse=int, check=_port)
BODY_BYTES = Kind("bytes", parse=size_arg, check=_some_bytes, metavar="SIZE")
WORDS = Kind("text", action="extend", nargs="+", render=list)  # --x A B --x C: (A, B, C)
# vLLM's list flags (argparse's store): --x A B --x C is (C,), so a launch line's later
# value, or the command line's after a --config file's, replaces the earlier one
LAST_WORDS = Kind("text", nargs="+", render=list)
PARSER = Kind("choice", parse=tool_call_parser, values=PARSERS, metavar="NAME",
              check=lambda _flag, value: tool_call_parser(value))
LOGPROBS = Kind("count", parse=max_logprobs, check=_logprobs, metavar="N")
JSON_OBJECT = Kind("object", parse=json_object, check=_object, metavar="JSON",
                   render=lambda value: [json.dumps(value)])
JSON_STRINGS = Kind("text", parse=json_strings, check=_strings, metavar="JSON",
                    render=lambda value: [json.dumps(list(value))])
