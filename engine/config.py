"""The engine's flags (vLLM's names) as one validated dataclass.

``add_engine_flags`` is shared by ``plan``, ``preflight``, ``serve`` and ``run`` so the
operator can hand the init container and the engine container the same argument list.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, fields

from kvledger.engine.checkpoint.hub.reads import DEFAULT_HUB_TIMEOUT_S
from kvledger.engine.checkpoint.hub.uri import is_hub_uri, parse_uri
from kvledger.engine.errors import BadInput
from kvledger.engine.lora_config import (
    DEFAULT_MAX_LORA_RANK,
    DEFAULT_MAX_LORAS,
    LoraModule,
    add_lora_flags,
    check_lora_flags,
)

DTYPES = ("auto", "bfloat16", "float16", "float32", "half", "float", "bf16", "fp16", "fp32")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2")
DEVICES = ("auto", "cuda", "cpu")
ADMISSIONS = ("reserve", "safe")  # --admission: engine/kv/ledger.py and engine/kv/safety.py
QUANTIZATIONS = ("fp8",)  # --quantization: what the engine quantizes to on load

DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_NUM_SEQS = 16
# Without chunked prefill a whole prompt is one step, so the per-step token budget is
# at least the context; 2048 keeps short-context models' activation peak realistic.
MIN_DEFAULT_BATCHED_TOKENS = 2048
# The compiled grammars of structured outputs (host memory): typical schemas compile to
# well under 1 MiB, a hostile one to tens of MiB. Counted in the plan where the device's
# memory is the host's (the CPU, a unified pool).
DEFAULT_GRAMMAR_CACHE_BYTES = 128 * 2**20

# The size grammar (Kubernetes quantities); the CRD's pattern is built from it (operator/crd_schema.py).
SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTPE]i?B?|[kKMGTPE]B|[kKMGTPE]|B)?\s*$")
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50, "E": 2**60}
_DECIMAL = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}


def parse_size(text: str | int) -> int:
    """Bytes from a SIZE: ``40GiB``/``40Gi`` (binary), ``40GB``/``40G`` (decimal), ``512MiB``,
    or plain bytes, as Kubernetes quantities. Raises BadInput on anything else."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise BadInput(f"size must not be negative: {text}")
        return text
    match = SIZE_RE.match(str(text))
    if not match:
        raise BadInput(f"bad size {text!r}: use e.g. 40GiB, 40Gi, 40GB, 40G, 512MiB or plain bytes")
    number, unit = match.group(1), (match.group(2) or "")
    unit = unit.upper()
    if unit in ("", "B"):
        scale = 1
    elif "I" in unit:
        scale = _BINARY[unit[0]]
    else:
        scale = _DECIMAL[unit[0]]
    value = float(number) * scale
    if scale == 1 and "." in number:
        raise BadInput(f"bad size {text!r}: a byte count must be a whole number")
    return int(value)


@dataclass(frozen=True)
class EngineConfig:
    """Every flag the planner and engine read. ``None`` means "derive it" (see docs/planner.md)."""

    model: str
    served_model_name: str | None = None
    served_model_aliases: tuple[str, ...] = ()  # more names it answers to (vLLM: the rest)
    max_model_len: int | None = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    quantization: str | None = None  # "fp8": quantize the linear layers on load
    tensor_parallel_size: int = 1  # GPUs one model is sharded over; the plan is per GPU
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    admission: str = "safe"  # over-commit KV while every request can finish; or "reserve"
    gpu_memory_utilization: float | None = None
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    memory_limit_bytes: int | None = None
    device: str = "auto"
    device_memory_bytes: int | None = None
    device_free_bytes: int | None = None
    container_memory_limit_bytes: int | None = None
    unified_memory: bool = False
    seed: int = 0
    download_dir: str | None = None  # the hub cache of an hf:// model (fetch and serve)
    grammar_cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES
    hub_timeout_s: float = DEFAULT_HUB_TIMEOUT_S  # an hf:// model's metadata reads, in all
    enable_lora: bool = False  # LoRA adapters: engine/lora_config.py
    lora_modules: tuple[LoraModule, ...] = ()
    max_loras: int = DEFAULT_MAX_LORAS
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                     "num_gpu_blocks_override", "kv_cache_memory_bytes", "memory_limit_bytes",
                     "device_memory_bytes", "container_memory_limit_bytes",
                     "grammar_cache_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value <= 0):
                flag = _FLAG_NAMES.get(name, name.replace("_", "-"))
                raise BadInput(f"--{flag} must be a positive integer, got {value!r}")
        if (self.max_num_batched_tokens is not None
                and self.max_num_batched_tokens < self.max_num_seqs):
            raise BadInput(f"--max-num-batched-tokens {self.max_num_batched_tokens} is below "
                           f"--max-num-seqs {self.max_num_seqs}: every running sequence decodes "
                           "one token per step")
        if self.admission not in ADMISSIONS:
            raise BadInput(f"--admission must be one of {', '.join(ADMISSIONS)}, got "
                           f"{self.admission!r}")
        if self.device_free_bytes is not None and self.device_free_bytes < 0:
            raise BadInput("--device-free must not be negative")
        if (self.device_free_bytes is not None and self.device_memory_bytes is not None
                and self.device_free_bytes > self.device_memory_bytes):
            raise BadInput("--device-free cannot exceed --device-memory")
        if self.device_free_bytes is not None and self.device_memory_bytes is None:
            raise BadInput("--device-free needs --device-memory")
        util = self.gpu_memory_utilization
        if util is not None and not (0.0 < util <= 1.0):
            raise BadInput(f"--gpu-memory-utilization must be in (0, 1], got {util}")
        if self.dtype not in DTYPES:
            raise BadInput(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise BadInput(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                           f"got {self.kv_cache_dtype!r}")
        if self.quantization is not None:
            quantization_arg(self.quantization)
        if self.device not in DEVICES:
            raise BadInput(f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if not self.model:
            raise BadInput("--model is required")
        if is_hub_uri(self.model):
            parse_uri(self.model)  # a malformed hf:// uri is bad input before anything runs
        if self.download_dir is not None and not self.download_dir:
            raise BadInput("--download-dir must not be empty")
        if (isinstance(self.hub_timeout_s, bool) or not isinstance(self.hub_timeout_s, int | float)
                or not 0 < self.hub_timeout_s < float("inf")):
            raise BadInput(f"--hub-timeout must be a positive number of seconds, got "
                           f"{self.hub_timeout_s!r}")
        object.__setattr__(self, "lora_modules", tuple(self.lora_modules))
        check_lora_flags(self.enable_lora, self.lora_modules, self.max_loras,
                         self.max_lora_rank, self.max_cpu_loras)

    def to_flags(self) -> list[str]:
        """The command-line flags that reproduce this config (inverse of the parser)."""
        out: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            if (value == f.default and f.name != "model") or f.name == "served_model_aliases":
                continue  # (the aliases follow the first name)
            flag = "--" + _FLAG_NAMES.get(f.name, f.name.replace("_", "-"))
            if isinstance(value, bool):
                # Differs from the default: --flag for a default-off flag, --no-flag else.
                out.append(flag if value else "--no-" + flag[2:])
            elif f.name == "served_model_name":
                out.extend([flag, value, *self.served_model_aliases])
            elif f.name == "lora_modules":
                out.extend([flag, *(m.as_flag() for m in value)])
            else:
                out.extend([flag, str(value)])
        return out


_FLAG_NAMES = {
    "memory_limit_bytes": "memory-limit",
    "device_memory_bytes": "device-memory",
    "device_free_bytes": "device-free",
    "container_memory_limit_bytes": "container-memory-limit",
    "grammar_cache_bytes": "grammar-cache-bytes",
    "hub_timeout_s": "hub-timeout",
}


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def quantization_arg(text: str) -> str:
    """``--quantization``: fp8, or one line naming the method refused (BadInput, exit 2)."""
    if text not in QUANTIZATIONS:
        raise BadInput(f"--quantization {text}: kvledger does not support vLLM's "
                       f"--quantization {text} (only fp8, quantized on load; a checkpoint's "
                       "own FP8, GPTQ, AWQ or compressed-tensors quantization_config needs "
                       "no flag: drop it)")
    return text


def size_arg(text: str) -> int:
    """argparse type for a SIZE flag."""
    try:
        return parse_size(text)
    except BadInput as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_seconds(text: str) -> float:
    """argparse type for a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not (0.0 < value <= 1.0):
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The flags shared by plan/preflight/serve, named as vLLM names them."""
    g = parser.add_argument_group("model and workload")
    g.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as `vllm serve MODEL` takes it: the same as --model")
    g.add_argument("--model", default=None,
                   help="checkpoint directory (config.json + safetensors), or a Hugging Face "
                        "Hub model hf://ORG/NAME[@REVISION] (token: $HF_TOKEN, mirror: "
                        "$HF_ENDPOINT)")
    g.add_argument("--hub-timeout", dest="hub_timeout_s", type=positive_seconds,
                   default=DEFAULT_HUB_TIMEOUT_S, metavar="SECONDS",
                   help="an hf:// model's listing, config and safetensors headers must be read "
                        f"within this (default {DEFAULT_HUB_TIMEOUT_S:g}; each file also within "
                        "60 s), else one error line, exit 2")
    g.add_argument("--download-dir", default=None, metavar="DIR",
                   help="the hub cache an hf:// model is fetched into and served from "
                        "(default: huggingface_hub's, $HF_HUB_CACHE or $HF_HOME/hub)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the name(s) requests use for the model (default: --model); with "
                        "several, as in vLLM, any is accepted, /v1/models lists them all and "
                        "answers carry the first")
    g.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="context limit in tokens (default: the model's max_position_embeddings)")
    # vLLM's defaults: vllm/engine/arg_utils.py get_batch_defaults (`vllm serve` context).
    g.add_argument("--max-num-seqs", type=_positive_int, default=DEFAULT_MAX_NUM_SEQS,
                   help=f"sequences running at once (default {DEFAULT_MAX_NUM_SEQS}; "
                        "vllm serve's is 256, 1024 on a GPU of 70 GiB or more other than an "
                        "A100, 128 on a CPU)")
    g.add_argument("--max-num-batched-tokens", type=_positive_int, default=None,
                   help="tokens per engine step (default max(max_model_len, "
                        f"{MIN_DEFAULT_BATCHED_TOKENS}): a whole prompt is one step; "
                        "vllm serve's is 2048, 8192 on a GPU of 70 GiB or more other than an "
                        "A100, as it splits prompts into chunks)")
    g.add_argument("--block-size", type=_positive_int, default=DEFAULT_BLOCK_SIZE)
    g.add_argument("--dtype", choices=DTYPES, default="auto")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    g.add_argument("--quantization", "-q", type=quantization_arg, default=None, metavar="fp8",
                   help="fp8: quantize the linear layers of a float16/bfloat16/float32 "
                        "checkpoint to FP8 on load, one scale per output channel (embeddings, "
                        "LM head and norms stay at --dtype); planned at that size")
    g.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=1, metavar="N",
                   help="shard the model over N GPUs of one machine, one process per GPU, as "
                        "vLLM shards it; every figure of the plan is what one GPU holds "
                        "(docs/planner.md, \"Tensor parallelism\")")
    g.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share the KV blocks of prompts that begin alike between requests, "
                        "as vLLM does by default")
    g.add_argument("--admission", choices=ADMISSIONS, default="safe",
                   help="safe (default): a request is admitted while every request admitted "
                        "can still reach its max_tokens in some order (the banker's "
                        "algorithm); KV blocks are drawn as tokens need them and a request "
                        "whose next block would break that pauses a step, keeping its KV: "
                        "more requests run in the same pool, none is preempted or recomputed, "
                        "none fails mid-decode. reserve: a request is admitted once prompt + "
                        "max_tokens of KV is free, and holds it to the end")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--grammar-cache-bytes", type=size_arg, default=DEFAULT_GRAMMAR_CACHE_BYTES,
                   metavar="SIZE",
                   help="host memory the compiled grammars of structured outputs may hold "
                        "(default 128MiB; least recently used out first; a schema larger on "
                        "its own is a 400); counted in the plan on the CPU and unified memory")
    m = parser.add_argument_group("memory caps (the smallest one given wins)")
    m.add_argument("--memory-limit", dest="memory_limit_bytes", type=size_arg, default=None,
                   metavar="SIZE", help="hard limit on the engine's device memory, e.g. 40GiB")
    m.add_argument("--gpu-memory-utilization", "--device-memory-utilization", type=_fraction,
                   default=None,
                   help="cap as a fraction of the device's TOTAL memory, in (0, 1]")
    m.add_argument("--num-gpu-blocks-override", type=_positive_int, default=None)
    m.add_argument("--kv-cache-memory-bytes", type=size_arg, default=None, metavar="SIZE")
    d = parser.add_argument_group("device (what-if planning without the card)")
    d.add_argument("--device", choices=DEVICES, default="auto")
    d.add_argument("--device-memory", dest="device_memory_bytes", type=size_arg, default=None,
                   metavar="SIZE", help="plan for a device with this much total memory")
    d.add_argument("--device-free", dest="device_free_bytes", type=size_arg, default=None,
                   metavar="SIZE", help="free memory on that device (default: all of it)")
    d.add_argument("--unified-memory", action="store_true",
                   help="the device shares one memory pool with the host (GB10, GH200, ...)")
    d.add_argument("--container-memory-limit", dest="container_memory_limit_bytes",
                   type=size_arg, default=None, metavar="SIZE",
                   help="read host memory (--device cpu, or a unified pool) as a container "
                        "with this memory limit sees it: total min(MemTotal, SIZE), free "
                        "min(MemAvailable, SIZE less this process's memory). The device's "
                        "size, not a cap like --memory-limit; `kvledger run` passes "
                        "spec.resources.limits.memory")
    add_lora_flags(parser)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the config from parsed flags; unknown namespace attributes are ignored."""
    values = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
    values["model"] = _model(getattr(args, "model_tag", None), getattr(args, "model", None))
    names = values.get("served_model_name")
    if isinstance(names, list):  # --served-model-name NAME [NAME ...]
        values["served_model_name"], values["served_model_aliases"] = names[0], tuple(names[1:])
    if values.get("lora_modules") is None:
        values.pop("lora_modules", None)
    return EngineConfig(**values)


def _model(positional: str | None, flag: str | None) -> str | None:
    """``vllm serve MODEL`` and ``--model MODEL`` are one setting; two different models is
    a launch line that means two things, so it is refused rather than one picked."""
    if positional and flag and positional != flag:
        raise BadInput(f"the model is given twice, {positional!r} and --model {flag!r}: "
                       "give one")
    return positional or flag
