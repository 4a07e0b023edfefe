"""Small built-in checkpoints, written deterministically (``kvledger make-model NAME DIR``:
``commands/make_model.py``).

Each is a real Hugging Face checkpoint directory (``config.json``, ``model.safetensors``,
``tokenizer.json`` trained on the bundled corpus, ``tokenizer_config.json`` with a chat
template, ``generation_config.json``) with random weights from a fixed seed (scaled for
stable, varied greedy output: ``builtin_weights``), so tests, demos and benchmarks go
through the same loading path as a user's checkpoint.

The checkpoint is built in a hidden folder beside DIR and renamed into place once
complete, so an interrupted run never leaves a half-written DIR. Files are 0644 and the
folder 0755 whatever the umask: a pod running as another user reads it from a hostPath.
"""

from __future__ import annotations

import contextlib
import errno
import filecmp
import json
import os
import shutil
import tempfile
import zlib
from pathlib import Path
from typing import Any

from kvledger.engine.errors import BadInput, clip
from kvledger.engine.model.bpe import train_byte_level_bpe
from kvledger.engine.model.builtin_weights import write_weights

CORPUS = Path(__file__).parent / "data" / "corpus.txt"
SPECIAL_TOKENS = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
TOKENIZER_VOCAB = 1024
# Hermes-style tool calling, as Qwen2.5's: the tools in the system turn, each call as
# <tool_call>{"name": ..., "arguments": ...}</tool_call>, tool results as user turns.
# Without tools it renders exactly as it always has; OpenAI's developer role is a system turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'developer', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "<|user|>\n<tool_response>\n{{ message['content'] }}\n</tool_response><|end|>\n"
    "{% elif message['role'] == 'assistant' and message.tool_calls %}"
    "<|assistant|>\n{{ message['content'] }}"
    "{% for call in message.tool_calls %}"
    "{% if message['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    "<tool_call>\n{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{% if call.function.arguments is string %}{{ call.function.arguments }}"
    "{% else %}{{ call.function.arguments | tojson }}{% endif %}}\n</tool_call>"
    "{% endfor %}<|end|>\n"
    "{% else %}<|{{ 'system' if message['role'] == 'developer' else message['role'] }}|>\n"
    "{{ message['content'] }}<|end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
          "rms_norm_eps": 1e-5, "attention_bias": False, "mlp_bias": False,
          "tie_word_embeddings": False, "torch_dtype": "float32", "initializer_range": 0.02}

MODELS: dict[str, dict[str, Any]] = {
    # Llama-3 shape: GQA, large rope_theta and llama3 rope_scaling, untied embeddings.
    "tiny-llama": {**_LLAMA, "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 4,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
                   "rope_theta": 500000.0,
                   "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 128}},
    # Mistral shape: a sliding window shorter than the context.
    "tiny-mistral": {**_LLAMA, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
                     "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3,
                     "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
                     "max_position_embeddings": 512, "rope_theta": 1000000.0, "sliding_window": 64},
    # Qwen2 shape: q/k/v bias, tied embeddings.
    "tiny-qwen2": {**_LLAMA, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                   "hidden_size": 128, "intermediate_size": 320, "num_hidden_layers": 3,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
                   "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                   "use_sliding_window": False, "sliding_window": None, "max_window_layers": 3},
    # Qwen3 shape: q/k norms, head_dim 64 with 4 heads (q is wider than hidden), tied.
    "tiny-qwen3": {**_LLAMA, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                   "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                   "max_position_embeddings": 512, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                   "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": None,
                   "max_window_layers": 3},
    # Mixtral shape: 8 experts in every layer, top-2, renormalised.
    "tiny-mixtral": {**_LLAMA, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                     "hidden_size": 128, "intermediate_size": 64, "num_hidden_layers": 3,
                     "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
                     "max_position_embeddings": 512, "rope_theta": 1000000.0, "sliding_window": None,
                     "num_local_experts": 8, "num_experts_per_tok": 2, "router_jitter_noise": 0.0},
    # Qwen3-MoE shape: q/k norms, 16 experts, top-4 renormalised, layer 1 dense (mlp_only_layers).
    "tiny-qwen3-moe": {**_LLAMA, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                       "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3,
                       "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
                       "max_position_embeddings": 512, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                       "use_sliding_window": False, "sliding_window": None, "num_experts": 16,
                       "num_experts_per_tok": 4, "moe_intermediate_size": 32, "norm_topk_prob": True,
                       "decoder_sparse_step": 1, "mlp_only_layers": [1]},
    # For benchmarks: big enough that batching, not Python overhead, decides throughput.
    "small-llama": {**_LLAMA, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 2048,
                    "rope_theta": 10000.0},
}


def write_model(name: str, out_dir: str | Path, *, force: bool = False) -> Path:
    """Write the built-in checkpoint ``name`` into ``out_dir``; same bytes on every run.

    ``out_dir`` is created, or filled when empty, or left as is when it already holds
    exactly these files. Anything else is BadInput unless ``force``. See install_model.
    """
    return install_model(name, out_dir, force=force)[0]


def install_model(name: str, out_dir: str | Path, *, force: bool = False) -> tuple[Path, bool]:
    """``(out_dir, written)``: build ``name`` in a hidden folder beside ``out_dir``, then
    rename it into place; ``written`` is False when ``out_dir`` already held the same bytes.

    Raises BadInput (nothing changed) for an unknown name, an ``out_dir`` that is not a
    folder, or one that holds anything else without ``force``; with ``force`` the old
    contents are removed only after the new checkpoint is in place. The hidden folder is
    removed on every failure, Ctrl-C included.
    """
    if name not in MODELS:
        raise BadInput(f"unknown built-in model {name!r}; choose one of: {', '.join(MODELS)}")
    out = Path(out_dir)
    try:  # through a symlink, replace the folder it points at, not the link
        target = Path(os.path.realpath(out)) if out.is_symlink() else Path(os.path.abspath(out))
    except OSError as exc:  # a name too long, ...
        raise BadInput(f"cannot write {name} to {clip(str(out))}: {exc.strerror or exc}") from None
    _entries(target, out)  # fail fast: not a folder, or unreadable
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BadInput(f"cannot create {target.parent}: {exc.strerror or exc}") from None
    staging: Path | None = None
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial",
                                        dir=target.parent))
        _write_checkpoint(name, staging)
        for path in staging.iterdir():
            path.chmod(0o644)
        staging.chmod(0o755)
        return out, _install(name, staging, target, out, force)
    except OSError as exc:
        hint = ""
        if exc.errno in (errno.EBUSY, errno.EXDEV):
            hint = " (a mount point? write into a folder inside it)"
        raise BadInput(f"cannot write {name} to {out}: {exc.strerror or exc}{hint}") from None
    finally:
        if staging is not None:
            _remove(staging)  # gone already once renamed into place


def _install(name: str, staging: Path, out: Path, shown: Path, force: bool) -> bool:
    """Move the complete checkpoint in ``staging`` to ``out`` (``shown`` in messages);
    False if ``out`` already had it."""
    if _entries(out, shown):
        difference = _difference(staging, out)
        if difference is None:
            return False
        if not force:
            raise BadInput(f"{shown} holds something other than {name} ({difference}); "
                           "nothing written (--force replaces it)")
        _replace(staging, out)
        return True
    try:
        os.rename(staging, out)  # onto nothing, or onto an empty folder
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):  # another run got there first
            return _install(name, staging, out, shown, force)
        raise
    return True


def _replace(staging: Path, out: Path) -> None:
    """Swap ``staging`` in for ``out``, then remove the old contents. On any failure the
    old contents go back to ``out`` (or, if even that fails, stay in a hidden folder)."""
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
    try:
        os.rename(out, old)  # onto the empty placeholder
        os.rename(staging, out)
    except BaseException:
        if os.path.lexists(out):
            with contextlib.suppress(OSError):
                old.rmdir()  # only ever removes the empty placeholder
        else:
            os.rename(old, out)
        raise
    _remove(old)


def _entries(path: Path, shown: Path | None = None) -> list[str] | None:
    """The names in folder ``path``; None when there is nothing at ``path``."""
    if not os.path.lexists(path):
        return None
    if not path.is_dir():
        raise BadInput(f"{shown or path} exists and is not a directory; nothing written")
    try:
        return sorted(os.listdir(path))
    except OSError as exc:
        raise BadInput(f"cannot read {shown or path}: {exc.strerror or exc}") from None


def _difference(new: Path, old: Path) -> str | None:
    """None when ``old`` holds exactly the files of ``new``, byte for byte; else what differs."""
    new_names = {p.name for p in new.iterdir()}
    old_names = set(_entries(old) or ())
    changed = sorted(n for n in new_names & old_names if not _same_file(new / n, old / n))
    parts = []
    if changed:
        parts.append(f"{_names(changed)} differ" + ("s" if len(changed) == 1 else ""))
    if new_names - old_names:
        parts.append(f"missing {_names(sorted(new_names - old_names))}")
    if old_names - new_names:
        parts.append(f"other files: {_names(sorted(old_names - new_names))}")
    return "; ".join(parts) or None


def _same_file(new: Path, old: Path) -> bool:
    try:
        return old.is_file() and filecmp.cmp(new, old, shallow=False)
    except OSError:
        return False


def _names(names: list[str], most: int = 4) -> str:
    shown = [n if n.isprintable() else repr(n) for n in names[:most]]
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(shown) + more


def _remove(path: Path) -> None:
    """Remove a folder of ours, finishing even when Ctrl-C lands in the middle."""
    try:
        shutil.rmtree(path, ignore_errors=True)
    except KeyboardInterrupt:
        shutil.rmtree(path, ignore_errors=True)
        raise


def _write_checkpoint(name: str, out: Path) -> None:
    tokenizer = _train_tokenizer()
    tokenizer.save(str(out / "tokenizer.json"))
    bos, eos, end = (tokenizer.token_to_id(t) for t in ("<s>", "</s>", "<|end|>"))
    config = {**MODELS[name], "vocab_size": tokenizer.get_vocab_size(),
              "bos_token_id": bos, "eos_token_id": eos}
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json",
                {"bos_token_id": bos, "eos_token_id": [eos, end], "do_sample": False})
    _write_json(out / "tokenizer_config.json",
                {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                 "add_bos_token": True, "model_max_length": config["max_position_embeddings"],
                 "chat_template": CHAT_TEMPLATE})
    write_weights(config, out / "model.safetensors", seed=zlib.crc32(name.encode()))


def _train_tokenizer():
    from tokenizers import processors

    tokenizer = train_byte_level_bpe(CORPUS.read_text().splitlines(), TOKENIZER_VOCAB,
                                     SPECIAL_TOKENS)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    return tokenizer


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
