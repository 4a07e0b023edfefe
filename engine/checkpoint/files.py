"""The files of a checkpoint folder the engine reads, named once.

``kvledger serve DIR`` reads these from the folder (the config, the tokenizer and its chat
templates, the sampling defaults, the weights), and a hub model is downloaded as exactly
these (``hub/repo.py``'s ``engine_files``), so a model served by hub id reads what the same
folder served from disk reads: a file left out of the download is a promise (a chat
template, an EOS id, a sampling default) the hub path silently breaks. The readers take
their names from here; ``tests/server/test_hub_chat.py`` records the files the engine opens
from a folder and compares them with what the hub fetch selects.

What the engine does not read is not downloaded: ``special_tokens_map.json`` (the tokens
are in ``tokenizer.json`` and ``tokenizer_config.json``), a slow tokenizer's
``tokenizer.model`` / ``vocab.json`` + ``merges.txt`` / ``added_tokens.json`` (the engine
needs ``tokenizer.json``, from the model's folder or ``--tokenizer DIR``), pytorch ``.bin``
weights. Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from kvledger.engine import json_text
from kvledger.engine.errors import BadInput, shown

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# transformers 5 writes the default chat template here, and named ones (tool_use, ...)
# as NAME.jinja in the folder (its CHAT_TEMPLATE_FILE and CHAT_TEMPLATE_DIR).
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
TEMPLATE_SUFFIX = ".jinja"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_SUFFIX = ".safetensors"

# Read when the folder has them, besides the weights and the named chat templates.
ENGINE_FILES = (CONFIG_FILE, GENERATION_CONFIG_FILE, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE,
                CHAT_TEMPLATE_FILE)


def is_named_template(name: str) -> bool:
    """``additional_chat_templates/NAME.jinja``, directly in that folder."""
    parts = PurePosixPath(name).parts
    return (len(parts) == 2 and parts[0] == CHAT_TEMPLATE_DIR
            and parts[1].endswith(TEMPLATE_SUFFIX) and parts[1] != TEMPLATE_SUFFIX)


def read_beside_weights(names: Iterable[str]) -> list[str]:
    """Of a folder's files (paths relative to it, '/'-separated), those the engine reads
    besides the weights: ``ENGINE_FILES`` that exist, then the named chat templates."""
    present = set(names)
    return ([name for name in ENGINE_FILES if name in present]
            + sorted(name for name in present if is_named_template(name)))


def unindexed_weights(names: Iterable[str]) -> list[str]:
    """The safetensors a folder without an index is loaded from: ``model.safetensors``
    when it has one, else every ``*.safetensors`` at its top, sorted (empty: none)."""
    present = set(names)
    if SINGLE_FILE in present:
        return [SINGLE_FILE]
    return sorted(n for n in present if "/" not in n and n.endswith(WEIGHTS_SUFFIX))


# The longest file name (one path component) Linux file systems hold, in bytes.
MAX_NAME_BYTES = 255


def shard_name(name: str, where: str) -> str:
    """``name`` as the index ``where`` names a shard, refused (BadInput, one line) unless
    it is a file inside the checkpoint's folder: no absolute path, no ``..``, no backslash,
    each part a name a file system can hold (a longer one raised OSError from ``stat``).
    The planner, the hub's listing and the loader all check a shard by this rule."""
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts or "\\" in name:
        raise BadInput(f"{where}: shard {shown(name)} is outside the model directory")
    if any(len(part.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES for part in path.parts):
        raise BadInput(f"{where}: shard {shown(name)} has a name longer than "
                       f"{MAX_NAME_BYTES} bytes, which no file system holds")
    return name


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors the model is loaded from: the index's shards, else those a folder
    without an index is loaded from (``unindexed_weights``, which the hub fetch takes)."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json_text.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise BadInput(f"{index}: bad safetensors index: {exc}") from None
        return [model_dir / shard_name(name, str(index)) for name in sorted(set(weight_map.values()))]
    shards = unindexed_weights(p.name for p in model_dir.iterdir())
    if not shards:
        raise BadInput(f"{model_dir}: no *.safetensors weights (pytorch .bin is not supported)")
    return [model_dir / name for name in shards]
