"""What each of the engine's settings accepts (``*_config.py`` declare the settings): the
values of its choices, its defaults, the argument kinds the settings share beyond
``kinds.py``'s, and the ``--help`` groups they are shown in."""

from __future__ import annotations

from kvledger.engine.checkpoint.read_ahead import STRATEGIES
from kvledger.engine.errors import BadInput
from kvledger.engine.settings.kinds import Kind, positive_int

DTYPES = ("auto", "bfloat16", "float16", "float32", "half", "float", "bf16", "fp16", "fp32")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2")
DEVICES = ("auto", "cuda", "cpu")
# vLLM's names for the two attention paths kvledger has (planner/attention.py says which
# reads the cache in place); CPU_ATTN, vLLM's CPU backend, is TORCH_SDPA here.
ATTENTION_BACKENDS = ("auto", "TRITON_ATTN", "TORCH_SDPA", "CPU_ATTN")
ADMISSIONS = ("reserve", "safe")  # --admission: engine/kv/ledger.py and engine/kv/safety.py
# vLLM's --logprobs-mode: the model's log-probabilities or logits, raw or as sampled.
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
POLICIES = ("fcfs", "priority")  # vLLM's --scheduling-policy: engine/admission/order.py
QUANTIZATIONS = ("fp8",)  # --quantization: what the engine quantizes to on load

DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_NUM_SEQS = 16
MIN_DEFAULT_BATCHED_TOKENS = 2048  # the step budget's least default: a realistic peak
# Structured outputs' compiled grammars (host memory; typical schemas well under 1 MiB, a
# hostile one tens of MiB): planned where the device's memory is the host's (CPU, unified).
DEFAULT_GRAMMAR_CACHE_BYTES = 128 * 2**20
# The most logprobs a token reports (vLLM's default --max-logprobs): the bound of serve's
# --max-logprobs and of a request's logprobs (sampling/params.py).
MAX_LOGPROBS = 20


def quantization_arg(text: str) -> str:
    """``--quantization``: fp8, or one line naming the method refused (BadInput, exit 2)."""
    if text not in QUANTIZATIONS:
        raise BadInput(f"--quantization {text}: kvledger does not support vLLM's "
                       f"--quantization {text} (only fp8, quantized on load; a checkpoint's "
                       "own FP8, GPTQ, AWQ or compressed-tensors quantization_config needs "
                       "no flag: drop it)")
    return text


def load_strategy_arg(text: str) -> str:
    """``--safetensors-load-strategy``: lazy, eager or prefetch (checkpoint/read_ahead.py),
    or one line naming what is refused (BadInput, exit 2)."""
    if text not in STRATEGIES:
        what = ("torchao's tensor subclasses" if text == "torchao"
                else f"a load strategy {text!r}")
        raise BadInput(f"--safetensors-load-strategy {text}: kvledger does not read "
                       f"{what}; lazy, eager or prefetch")
    return text


# The --help groups, in the order they are listed.
WORKLOAD = "model and workload"
MEMORY = "memory caps (the smallest one given wins)"
DEVICE = "device (what-if planning without the card)"
LORA = "LoRA adapters (vLLM's flags)"

QUANTIZATION = Kind("choice", parse=quantization_arg,
                    check=lambda _flag, value: quantization_arg(value), values=QUANTIZATIONS)
LOAD_STRATEGY = Kind("choice", parse=load_strategy_arg,
                     check=lambda _flag, value: load_strategy_arg(value), values=STRATEGIES)
NAMES = Kind("text", nargs="+", metavar="NAME")  # the aliases follow the first (to_flags)


def _positive_ints(flag: str, value: object) -> None:
    if not isinstance(value, list | tuple) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
        raise BadInput(f"{flag} must be positive integers, got {value!r}")


SIZES = Kind("sizes", parse=positive_int, check=_positive_ints, nargs="+", metavar="N",
             render=lambda sizes: [str(s) for s in sizes])
