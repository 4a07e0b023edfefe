"""A model's published sampling defaults (``generation_config.json``), applied as vLLM
applies them (``--generation-config``): ``auto`` (vLLM's default) reads the model's own
file, ``vllm`` ignores it, a folder reads that folder's; ``--override-generation-config``'s
JSON goes over what was read (over nothing with ``vllm``). A request's own value always
wins; one it leaves unset takes the default, else the neutral one.

A folder without ``generation_config.json`` gives the sampling values its ``config.json``
states at its top level, as vLLM's ``try_get_generation_config`` takes them then
(transformers' ``GenerationConfig.from_model_config``; older checkpoints kept them there).

What is read (vLLM's ``get_diff_sampling_param``): ``temperature``, ``top_p``, ``top_k``,
``min_p``, ``repetition_penalty`` and ``max_new_tokens`` (the default ``max_tokens`` of a
request that names none: a chat's, a completion's only when sent as null, since a
completion's default is 16). ``max_new_tokens`` also caps every request, whatever it asks,
when it comes from a folder's file or from the override (vLLM's ``override_max_tokens``).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from kvledger.engine.checkpoint.files import CONFIG_FILE, GENERATION_CONFIG_FILE
from kvledger.engine.checkpoint.hf_config import read_json
from kvledger.engine.errors import BadInput, shown

AUTO, VLLM = "auto", "vllm"
# generation_config.json's name -> SamplingParams' (max_new_tokens is max_tokens there)
READ = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
OVERRIDE_FLAG = "--override-generation-config"


def sampling_defaults(model_dir: str | Path, source: str = AUTO,
                      overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The defaults ``source`` gives with ``overrides`` over them (SamplingParams' names;
    the keys of ``READ`` only, as vLLM reads them): {} for ``vllm`` without overrides or a
    model without the file. BadInput for a folder that is not there, a file that is not
    JSON, or a value of the wrong type."""
    raw: dict[str, Any] = {}
    where = OVERRIDE_FLAG
    if source != VLLM:
        folder = Path(model_dir) if source == AUTO else Path(source)
        if source != AUTO and not os.path.isdir(folder):  # False for a name too long
            raise BadInput(f"--generation-config {shown(source)}: not 'auto', 'vllm' or a folder")
        path = published_file(folder)
        if path is not None:
            raw = read_json(path, path.name)
            if not isinstance(raw, dict):
                raise BadInput(f"{path}: must be a JSON object, got {type(raw).__name__}")
            if path.name == CONFIG_FILE:  # its sampling values, nothing else of it
                raw = {name: raw[name] for name in READ if name in raw}
            where = str(path)
    if overrides:
        raw = {**raw, **overrides}
        where = f"{where} and {OVERRIDE_FLAG}" if where != OVERRIDE_FLAG else where
    defaults = {}
    for name, param in READ.items():
        value = raw.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise BadInput(f"{where}: {name} must be a number, got {value!r}")
        if param in ("top_k", "max_tokens"):
            if value != int(value):
                raise BadInput(f"{where}: {name} must be a whole number, got {value!r}")
            value = int(value)
        defaults[param] = value
    return defaults


def published_file(folder: Path) -> Path | None:
    """The file whose sampling values ``folder`` publishes: its generation_config.json,
    else its config.json (vLLM's fallback), else None."""
    for name in (GENERATION_CONFIG_FILE, CONFIG_FILE):
        if (folder / name).is_file():
            return folder / name
    return None


def max_tokens_cap(defaults: dict[str, Any], source: str = AUTO,
                   overrides: dict[str, Any] | None = None) -> int | None:
    """The most tokens any request may generate, whatever it asks (vLLM's
    ``override_max_tokens``): a folder's ``max_new_tokens`` (``defaults``, read with the
    overrides), else the override's own; None: no such cap."""
    if source not in (AUTO, VLLM):
        return defaults.get("max_tokens")
    if overrides and overrides.get("max_new_tokens") is not None:
        return defaults.get("max_tokens")  # the override's, checked as defaults read it
    return None


def stop_ids(model_dir: str | Path, source: str = AUTO) -> list[int]:
    """The ids that end generation besides the tokenizer's EOS, as vLLM takes them (its
    ``try_get_generation_config``): ``eos_token_id`` of the generation_config.json of
    ``source``'s folder (the model's for ``auto`` and ``vllm``, which drops only the
    sampling defaults), else of the model's config.json when there is no such file. A
    config.json's ids do not stop a model whose generation_config.json leaves them out."""
    folder = Path(model_dir) if source in (AUTO, VLLM) else Path(source)
    path = folder / GENERATION_CONFIG_FILE
    if not path.is_file():
        path = Path(model_dir) / CONFIG_FILE
        if not path.is_file():
            return []
    raw = read_json(path, path.name)
    eos = raw.get("eos_token_id") if isinstance(raw, dict) else None
    ids = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else []
    return [i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0]


def describe(defaults: dict[str, Any], source: str, overrides: dict[str, Any] | None = None,
             cap: int | None = None, model_dir: str | Path | None = None) -> str:
    """The start-up line that says which defaults apply (and the cap on every request)."""
    read = None
    if source not in (AUTO, VLLM):
        read = published_file(Path(source))
    elif source == AUTO and model_dir is not None:
        read = published_file(Path(model_dir))
    name = read.name if read is not None else GENERATION_CONFIG_FILE
    where = {AUTO: f"the model's {name}", VLLM: "vLLM's neutral ones"}.get(
        source, f"{source}/{name}")
    if overrides:
        where += f" and {OVERRIDE_FLAG}"
    if not defaults:
        return "sampling defaults: vLLM's neutral ones (" + (
            "--generation-config vllm" if source == VLLM else f"none in {where}") + ")"
    shown = ", ".join(f"{k}={v}" for k, v in defaults.items())
    capped = f"; at most {cap} tokens for every request" if cap is not None else ""
    return (f"sampling defaults from {where} for requests that do not set them: {shown} "
            f"(--generation-config vllm to use vLLM's neutral ones){capped}")
