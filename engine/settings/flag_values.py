"""Values of flags that both ``kvledger serve`` (its settings, ``serve_values.py``) and the
vLLM flags ``plan`` and ``preflight`` accept without using (``vllm_rules.py``) read the
same way, so a launch line whose value serve refuses is refused by plan too: JSON objects
and lists, log levels, optional counts, the logprobs limit, TLS's client-certificate
demand. Each is an argparse type: a bad value is ``argparse.ArgumentTypeError``, which the
command line turns into one ``error:`` line.
"""

from __future__ import annotations

import argparse

from kvledger.engine import json_text
from kvledger.engine.errors import BadInput
from kvledger.engine.settings.config_values import MAX_LOGPROBS

# vLLM's --log-level (vllm/config/logging.py's LogLevel, upper case) in Python's names;
# kvledger reads any case. NOTSET, vLLM's "inherit the parent's level", has no meaning for
# kvledger's one logger tree and is refused as any other unknown level.
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
# vLLM's --uvicorn-log-level (vllm/entrypoints/launchers/cli_args.py): argparse choices,
# exact lower-case names as vLLM compares them.
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# vLLM's --chat-template-content-format (model/chat_template.py reads them).
CONTENT_FORMATS = ("auto", "string", "openai")


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


def log_level(text: str) -> str:
    """argparse type for ``--log-level``: one of ``LOG_LEVELS`` in any case (vLLM spells
    them ``DEBUG``, kvledger ``debug``), as its lower-case name."""
    level = text.lower()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from "
                                         f"{', '.join(LOG_LEVELS)}, in any case)")
    return level


def optional_int(text: str) -> int | None:
    """argparse type of vLLM's optional integers (``--max-log-len``): a whole number, or
    ``None``/empty for none, as vLLM's ``optional_type(int)`` reads them."""
    if text in ("", "None"):
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def optional_float(text: str) -> float | None:
    """argparse type of vLLM's optional numbers (``--video-pruning-rate``): a number, or
    ``None``/empty for none, as vLLM's ``optional_type(float)`` reads them."""
    if text in ("", "None"):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def optional_json_object(text: str) -> dict | None:
    """argparse type of vLLM's optional JSON flags (``--mm-processor-kwargs``): a JSON
    object, or ``None``/empty for none."""
    return None if text in ("", "None") else json_object(text)


def optional_text(text: str) -> str | None:
    """argparse type of vLLM's optional strings (``--revision``): ``None``/empty for none,
    as vLLM's ``optional_type(str)`` reads them."""
    return None if text in ("", "None") else text


def too_many_logprobs(flag: str, given: object) -> BadInput:
    return BadInput(f"{flag} {given}: kvledger reports at most {MAX_LOGPROBS} logprobs per "
                    f"token (0-{MAX_LOGPROBS})")


def max_logprobs(text: str) -> int:
    """--max-logprobs: 0..MAX_LOGPROBS; vLLM's -1 (the vocabulary) is refused by name, by
    serve and by plan alike (a pre-flight that passed it would leave serve to exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 0 <= value <= MAX_LOGPROBS:
        raise too_many_logprobs("--max-logprobs", text)
    return value


# vLLM's --ssl-cert-reqs: uvicorn's int of Python's ssl.VerifyMode.
VERIFY_MODES = {0: "none", 1: "optional", 2: "required"}


def bad_cert_reqs(flag: str, given: object) -> BadInput:
    return BadInput(f"{flag} {given}: must be 0 (no client certificate), 1 (optional) or 2 "
                    "(required), as uvicorn's ssl.VerifyMode")


def cert_reqs(text: str) -> int:
    """--ssl-cert-reqs: 0, 1 or 2 (``ssl.CERT_NONE``, ``CERT_OPTIONAL``, ``CERT_REQUIRED``);
    any other is refused by serve and plan alike (vLLM's uvicorn fails on it at start)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 0, 1 or 2, got {text!r}") from None
    if value not in VERIFY_MODES:
        raise bad_cert_reqs("--ssl-cert-reqs", text)
    return value
