"""What each of ``kvledger serve``'s own options accepts (``serve_config.py`` declares the
options): the kinds beyond ``kinds.py``'s, and the ``--help`` groups they are shown in."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvledger.engine.errors import BadInput
from kvledger.engine.settings.config_values import MAX_LOGPROBS
from kvledger.engine.settings.flag_values import (
    LOG_LEVELS,
    VERIFY_MODES,
    bad_cert_reqs,
    cert_reqs,
    json_object,
    json_strings,
    log_level,
    max_logprobs,
    too_many_logprobs,
)
from kvledger.engine.settings.kinds import Kind, size_arg
from kvledger.engine.settings.reasoning_parsers import REASONING_PARSERS
from kvledger.engine.settings.structured_outputs_config import StructuredOutputsConfig
from kvledger.engine.settings.vllm_rules import PARSERS, RULES, refusal

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


def reasoning_parser(name: str) -> str:
    """One of ``REASONING_PARSERS``; any other is refused by name as plan refuses it."""
    if name not in REASONING_PARSERS:
        raise BadInput(refusal("--reasoning-parser", [name], RULES["--reasoning-parser"]))
    return name


def _logprobs(flag: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
        raise too_many_logprobs(flag, value)


def _strings(flag: str, value: Any) -> None:
    if not (isinstance(value, tuple | list) and all(isinstance(v, str) and v for v in value)):
        raise BadInput(f"{flag} must be a list of strings, got {value!r}")


def _object(flag: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise BadInput(f"{flag} must be a JSON object, got {value!r}")


def _structured_outputs(flag: str, value: Any) -> None:
    if not isinstance(value, StructuredOutputsConfig):
        raise BadInput(f"{flag} must be vLLM's structured outputs config, got {value!r}")


def _log_level(flag: str, value: Any) -> None:
    if not isinstance(value, str) or value.lower() not in LOG_LEVELS:
        raise BadInput(f"{flag} must be one of {', '.join(LOG_LEVELS)} (in any case), got "
                       f"{value!r}")


def _cert_reqs(flag: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value not in VERIFY_MODES:
        raise bad_cert_reqs(flag, value)


def root_path(text: str) -> str | None:
    """argparse type of ``--root-path``: a path prefix, ``/`` then segments (a trailing
    ``/`` dropped; ``/`` alone or empty: none)."""
    prefix = text.rstrip("/")
    if not prefix:
        return None
    if not text.startswith("/") or any(c in text for c in "?#%") or not text.isprintable():
        raise argparse.ArgumentTypeError(f"expected a path prefix such as /llama, got {text!r}")
    return prefix


def _root_path(flag: str, value: Any) -> None:
    if not isinstance(value, str) or root_path(value) != value:
        raise BadInput(f"{flag} must be a path prefix such as /llama, got {value!r}")


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
REASONING_PARSER = Kind("choice", parse=reasoning_parser, values=REASONING_PARSERS,
                        metavar="NAME", check=lambda _flag, value: reasoning_parser(value))
LOGPROBS = Kind("count", parse=max_logprobs, check=_logprobs, metavar="N")
JSON_OBJECT = Kind("object", parse=json_object, check=_object, metavar="JSON",
                   render=lambda value: [json.dumps(value)])
# vLLM's --log-level spells them DEBUG, kvledger's serve debug: either, any case.
LOG_LEVEL = Kind("choice", parse=log_level, check=_log_level, values=LOG_LEVELS,
                 metavar="LEVEL")
# uvicorn's ssl_cert_reqs (ssl.VerifyMode): 0 none, 1 optional, 2 required.
CERT_REQS = Kind("choice", parse=cert_reqs, check=_cert_reqs, metavar="0|1|2")
ROOT_PATH = Kind("text", parse=root_path, check=_root_path, metavar="PREFIX")
JSON_STRINGS = Kind("text", parse=json_strings, check=_strings, metavar="JSON",
                    render=lambda value: [json.dumps(list(value))])
# vLLM's JSON, read once (structured_outputs_config.py), rendered back the same way; the
# spec's camelCase object read into it.
STRUCTURED_OUTPUTS = Kind("structured_outputs", parse=StructuredOutputsConfig.parse,
                          check=_structured_outputs, metavar="JSON",
                          render=lambda value: [value.to_json()],
                          from_spec=StructuredOutputsConfig.from_spec)
