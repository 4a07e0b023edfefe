"""The workload's settings (vLLM's names): the model and where it comes from, how its files
are read, its context and batch, its dtypes and parallelism, CUDA graphs, the attention
backend, the prefix cache and its events, quantization, admission and scheduling, the
sampling defaults, the tokenizer and the grammars' cache (``--help``'s first group).

``EngineConfig`` (``config.py``) composes them with the device's and LoRA's settings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass
from typing import Any

from kvledger.engine.checkpoint.hub.reads import DEFAULT_HUB_TIMEOUT_S
from kvledger.engine.checkpoint.hub.uri import is_hub_uri, model_reference, parse_uri
from kvledger.engine.checkpoint.read_ahead import (
    DEFAULT_BLOCK_BYTES,
    DEFAULT_THREADS,
    WeightReading,
)
from kvledger.engine.errors import BadInput
from kvledger.engine.settings.config_values import (
    ADMISSIONS,
    ATTENTION_BACKENDS,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_GRAMMAR_CACHE_BYTES,
    DEFAULT_MAX_NUM_SEQS,
    DTYPES,
    KV_CACHE_DTYPES,
    LOAD_STRATEGY,
    LOGPROBS_MODES,
    MIN_DEFAULT_BATCHED_TOKENS,
    NAMES,
    POLICIES,
    QUANTIZATION,
    SIZES,
    WORKLOAD,
)
from kvledger.engine.settings.declare import Crd, setting
from kvledger.engine.settings.kinds import (
    BYTES,
    INTEGER,
    PATH,
    POSITIVE_INT,
    SECONDS,
    SHARE,
    SWITCH,
    TEXT,
    TOKENS,
    Kind,
    choice,
)
from kvledger.engine.settings.kv_events_config import HASH_ALGOS, KVEventsConfig
from kvledger.engine.settings.node_config import Nodes
from kvledger.engine.settings.serve_values import JSON_OBJECT

# vLLM's JSON, read once (kv_events_config.py); rendered back the same way.
KV_EVENTS = Kind("text", parse=KVEventsConfig.parse, render=lambda c: [c.to_json()])


@dataclass(frozen=True)
class WorkloadSettings:
    """What is served and how, each declared once (``setting``); checked together by
    ``check_workload``."""

    model: str = setting(
        MISSING, "--model", TEXT, group=WORKLOAD,
        help="checkpoint directory (config.json + safetensors), or a Hugging Face Hub model "
             "hf://ORG/NAME[@REVISION] (token: $HF_TOKEN, mirror: $HF_ENDPOINT)")
    hub_timeout_s: float = setting(
        DEFAULT_HUB_TIMEOUT_S, "--hub-timeout", SECONDS, group=WORKLOAD,
        help="an hf:// model's listing, config and safetensors headers must be read within "
             f"this (default {DEFAULT_HUB_TIMEOUT_S:g}; each file also within 60 s), else one "
             "error line, exit 2")
    download_dir: str | None = setting(
        None, "--download-dir", PATH, metavar="DIR", group=WORKLOAD,
        help="the hub cache an hf:// model is fetched into and served from (default: "
             "huggingface_hub's, $HF_HUB_CACHE or $HF_HOME/hub)")
    safetensors_load_strategy: str | None = setting(
        None, "--safetensors-load-strategy", LOAD_STRATEGY, metavar="{lazy,eager,prefetch}",
        group=WORKLOAD,
        help="how the checkpoint's files are read, as vLLM reads them: lazy (as the memory "
             "map takes each tensor), prefetch (read ahead into the page cache by a pool of "
             "threads while loading), eager (each file read whole before its tensors); "
             "default: lazy, prefetched on NFS, Lustre or FUSE where the files fit in 90%% "
             "of the host memory available",
        crd=Crd("engine", "how the checkpoint's files are read: lazy, prefetch or eager "
                          "(--safetensors-load-strategy; unset: prefetched on NFS, "
                          "Lustre or FUSE)"))
    safetensors_prefetch_num_threads: int = setting(
        DEFAULT_THREADS, "--safetensors-prefetch-num-threads", POSITIVE_INT, metavar="N",
        group=WORKLOAD,
        help=f"threads that read the files ahead (default {DEFAULT_THREADS})")
    safetensors_prefetch_block_size: int = setting(
        DEFAULT_BLOCK_BYTES, "--safetensors-prefetch-block-size", BYTES, group=WORKLOAD,
        help=f"bytes each read ahead (or eager read) asks at a time (default "
             f"{DEFAULT_BLOCK_BYTES}, 16 MiB)")
    served_model_name: str | None = setting(
        None, "--served-model-name", NAMES, group=WORKLOAD,
        help="the name(s) requests use for the model (default: --model); with several, as in "
             "vLLM, any is accepted, /v1/models lists them all and answers carry the first")
    served_model_aliases: tuple[str, ...] = setting(  # the rest of --served-model-name
        (), None, TEXT, group=WORKLOAD)
    max_model_len: int | None = setting(
        None, "--max-model-len", TOKENS, group=WORKLOAD,
        help="context limit in tokens, as vLLM reads it: 4096, 32k (32,000), 32K (32,768); "
             "default: the model's max_position_embeddings (times a RoPE scaling's factor, "
             "as vLLM derives it; a longrope model's original_max_position_embeddings, as "
             "vLLM's default)",
        crd=Crd("engine", "context limit in tokens (--max-model-len)"))
    # None: not given. Under a cap (--gpu-memory-utilization, --memory-limit) the KV pool
    # decides, as in vLLM: as many whole max_model_len sequences as it holds, at most vllm
    # serve's default (vllm/engine/arg_utils.py get_batch_defaults, planner/seats.py).
    max_num_seqs: int | None = setting(
        None, "--max-num-seqs", POSITIVE_INT, group=WORKLOAD,
        help="sequences running at once. Not given: under a cap, as many max_model_len "
             "sequences as the KV pool left under it holds, at most vllm serve's default "
             "(256, 1024 on a GPU of 70 GiB or more other than an A100, 128 on a CPU); "
             f"without a cap or with an explicit pool, {DEFAULT_MAX_NUM_SEQS}",
        crd=Crd("engine", "concurrent sequences (--max-num-seqs; unset: what the KV pool "
                          "holds under a cap, else 16)"))
    max_num_batched_tokens: int | None = setting(
        None, "--max-num-batched-tokens", TOKENS, group=WORKLOAD,
        help=f"tokens per engine step (default max(max_model_len, {MIN_DEFAULT_BATCHED_TOKENS}): "
             "a whole prompt is one step; vllm serve's is 2048, 8192 on a GPU of 70 GiB or "
             "more other than an A100, as it splits prompts into chunks)",
        crd=Crd("engine", "tokens per engine step (--max-num-batched-tokens)"))
    block_size: int = setting(
        DEFAULT_BLOCK_SIZE, "--block-size", POSITIVE_INT, group=WORKLOAD,
        help=f"tokens per KV block (default {DEFAULT_BLOCK_SIZE})",
        crd=Crd("engine", "tokens per KV block (--block-size)", schema={"maximum": 1024}))
    dtype: str = setting(
        "auto", "--dtype", choice(DTYPES), group=WORKLOAD,
        help="the model dtype (default auto: the checkpoint's, a float32 one in half "
             "precision on a GPU, as vLLM runs it)",
        crd=Crd("engine"))
    kv_cache_dtype: str = setting(
        "auto", "--kv-cache-dtype", choice(KV_CACHE_DTYPES), group=WORKLOAD,
        help="the KV cache's dtype (default auto: the model dtype; fp8 is fp8_e4m3, one byte)",
        crd=Crd("engine"))
    tensor_parallel_size: int = setting(  # the operator sets it from spec.gpus
        1, "--tensor-parallel-size", POSITIVE_INT, aliases=("-tp",), metavar="N", group=WORKLOAD,
        help="shard the model over N GPUs of one machine, one process per GPU, as vLLM shards "
             "it; every figure of the plan is what one GPU holds (docs/planner.md, \"Tensor "
             "parallelism\")")
    pipeline_parallel_size: int = setting(1, "--pipeline-parallel-size", POSITIVE_INT, aliases=(
        "-pp",), metavar="P", group=WORKLOAD, help="split the layers into P stages as vLLM "
        "splits them, one process a GPU, every plan figure per GPU of a stage", crd=Crd(
            "engine", "pipeline stages the pod's gpus (with nodes, the group's) are split into "
                      "(default 1; with nodes, nodes)"))
    nodes: Nodes | None = setting(None, None, TEXT, group=WORKLOAD)  # noqa: RUF009 (frozen); serve's --nnodes
    enforce_eager: bool = setting(
        False, "--enforce-eager", SWITCH, group=WORKLOAD,
        help="capture no CUDA graphs of decode steps and plan no memory for them, as vLLM's "
             "eager mode (core/decode_graphs.py)",
        crd=Crd("engine"))
    cudagraph_capture_sizes: tuple[int, ...] | None = setting(
        None, "--cudagraph-capture-sizes", SIZES, group=WORKLOAD,
        help="the decode batch sizes captured as CUDA graphs (default: 1, 2, 4, then every 8 "
             "up to --max-cudagraph-capture-size; none above --max-num-seqs)")
    max_cudagraph_capture_size: int | None = setting(
        None, "--max-cudagraph-capture-size", POSITIVE_INT, group=WORKLOAD,
        help="the largest decode batch captured as a CUDA graph (default 512)")
    attention_backend: str = setting(
        "auto", "--attention-backend", choice(ATTENTION_BACKENDS), group=WORKLOAD,
        help="TRITON_ATTN: a Triton kernel reads the KV blocks in place (a GPU's default); "
             "TORCH_SDPA (or CPU_ATTN): each sequence's blocks are gathered for torch's SDPA, "
             "which the plan counts as activation memory (the CPU's default)")
    enable_prefix_caching: bool = setting(
        True, "--enable-prefix-caching", SWITCH, group=WORKLOAD,
        help="share the KV blocks of prompts that begin alike between requests, as vLLM does "
             "by default",
        crd=Crd("engine", "share computed prompt blocks between requests (default true)"))
    enable_sleep_mode: bool = setting(
        False, "--enable-sleep-mode", SWITCH, group=WORKLOAD,
        help="serve vLLM's POST /sleep?level=1|2, POST /wake_up and GET /is_sleeping (with "
             "VLLM_SERVER_DEV_MODE=1, behind the API key): level 1 keeps the weights in host "
             "memory and frees the KV pool, level 2 frees both and reads the weights again "
             "on wake; one process only, no LoRA (docs/serving.md, sleep mode)",
        crd=Crd("engine", "vLLM's sleep mode (--enable-sleep-mode): spec.sleep puts the pods "
                          "to sleep and wakes them without a restart; one process a pod "
                          "(gpus at most 1, nodes 1, no adapters)"))
    prefix_caching_hash_algo: str = setting(
        "sha256", "--prefix-caching-hash-algo", choice(HASH_ALGOS), group=WORKLOAD,
        help="how the block keys KV events publish are made, as vLLM makes its own: sha256 "
             "(default) or sha256_cbor (what llm-d's router computes from a prompt); the "
             "prefix cache's own lookups are keyed apart either way")
    kv_events_config: KVEventsConfig | None = setting(  # noqa: RUF009 (a frozen dataclass)
        None, "--kv-events-config", KV_EVENTS, group=WORKLOAD, metavar="JSON",
        help="publish KV-cache events (blocks stored, removed, all cleared) for a router "
             "that routes by prefix, as vLLM's JSON: {\"enable_kv_cache_events\": true, "
             "\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": ..., "
             "\"topic\": ...} (docs/serving.md, KV-cache events)")
    quantization: str | None = setting(  # "fp8": quantize the linear layers on load
        None, "--quantization", QUANTIZATION, aliases=("-q",), metavar="fp8", group=WORKLOAD,
        help="fp8: quantize the linear layers of a float16/bfloat16/float32 checkpoint to FP8 "
             "on load, one scale per output channel (embeddings, LM head and norms stay at "
             "--dtype); planned at that size",
        crd=Crd("engine", "quantize the linear layers to this format on load (--quantization); "
                          "a checkpoint's own FP8 needs none"))
    admission: str = setting(
        "safe", "--admission", choice(ADMISSIONS), group=WORKLOAD,
        help="safe (default): a request is admitted while every request admitted can still "
             "reach its max_tokens in some order (the banker's algorithm); KV blocks are drawn "
             "as tokens need them and a request whose next block would break that pauses a "
             "step, keeping its KV: more requests run in the same pool, none is preempted or "
             "recomputed, none fails mid-decode. reserve: a request is admitted once prompt + "
             "max_tokens of KV is free, and holds it to the end",
        crd=Crd("engine", "safe (default): admitted while every request admitted can still "
                          "reach its cap, more run at once; reserve: a request holds prompt + "
                          "max_tokens of KV from admission to its end (--admission)"))
    scheduling_policy: str = setting(
        "fcfs", "--scheduling-policy", choice(POLICIES), group=WORKLOAD,
        help="vLLM's: fcfs (default; a request's priority must be 0), or priority: a lower "
             "request priority is admitted and seated sooner; nothing running is preempted",
        crd=Crd("engine", "fcfs (default) or priority (--scheduling-policy)"))
    priority_headroom: float = setting(
        0.0, "--priority-headroom", SHARE, group=WORKLOAD,
        help="with --scheduling-policy priority: this share of the KV pool and of the seats "
             "(e.g. 10%%) only requests of priority at most --headroom-priority may take, so "
             "an urgent request is admitted and seated at the next step (default 0: none)",
        crd=Crd("engine", "share in [0, 1) of the KV pool and seats kept for urgent "
                          "requests (--priority-headroom)"))
    headroom_priority: int = setting(
        0, "--headroom-priority", INTEGER, group=WORKLOAD,
        help="the highest priority value that may take the --priority-headroom (default 0)",
        crd=Crd("engine", "the highest priority that may take it (--headroom-priority)"))
    seed: int = setting(
        0, "--seed", INTEGER, group=WORKLOAD,
        help="the seed of random sampling (default 0)",
        crd=Crd("engine", schema={"minimum": 0}))
    logprobs_mode: str = setting(  # sampling/logprobs.py
        "raw_logprobs", "--logprobs-mode", choice(LOGPROBS_MODES), group=WORKLOAD,
        help="vLLM's: what logprobs and prompt_logprobs report: raw_logprobs (default: the "
             "model's), raw_logits, processed_logprobs or processed_logits (after bias, "
             "penalties, bad words, allowed tokens, the grammar, min_tokens, then temperature, "
             "min_p, top_k and top_p: the distribution sampled; prompt tokens' are raw)",
        crd=Crd("engine", "what logprobs report (--logprobs-mode): raw_logprobs, raw_logits, "
                          "processed_logprobs or processed_logits"))
    generation_config: str = setting(
        "auto", "--generation-config", PATH, metavar="auto|vllm|DIR", group=WORKLOAD,
        help="vLLM's: the sampling defaults (temperature, top_p, top_k, min_p, "
             "repetition_penalty, max_new_tokens) of requests that do not set them: 'auto' "
             "(default) the model's generation_config.json, 'vllm' none, DIR that folder's "
             "generation_config.json, whose max_new_tokens also caps every request",
        crd=Crd("engine", "sampling defaults for requests that do not set them: auto (the "
                          "model's generation_config.json), vllm (none) or a folder "
                          "(--generation-config)"))
    override_generation_config: Mapping[str, Any] = setting(
        None, "--override-generation-config", JSON_OBJECT, group=WORKLOAD, factory=dict,
        help="vLLM's: JSON over the sampling defaults --generation-config gives, e.g. "
             "'{\"temperature\": 0.5}' (over none with 'vllm'); its max_new_tokens also caps "
             "every request, as a --generation-config folder's does")
    tokenizer: str | None = setting(
        None, "--tokenizer", PATH, metavar="DIR", group=WORKLOAD,
        help="vLLM's: read the tokenizer (tokenizer.json, tokenizer_config.json, chat "
             "templates) from this folder instead of the model's")
    grammar_cache_bytes: int = setting(
        DEFAULT_GRAMMAR_CACHE_BYTES, "--grammar-cache-bytes", BYTES, group=WORKLOAD,
        help="host memory the compiled grammars of structured outputs may hold (default "
             "128MiB; least recently used out first; a schema larger on its own is a 400); "
             "counted in the plan on the CPU and unified memory")
    def check_workload(self) -> None:
        """BadInput, one line, for workload flags that contradict each other."""
        if not self.model:
            raise BadInput("--model is required")
        if (self.max_num_batched_tokens is not None and self.max_num_seqs is not None
                and self.max_num_batched_tokens < self.max_num_seqs):
            raise BadInput(f"--max-num-batched-tokens {self.max_num_batched_tokens} is below "
                           f"--max-num-seqs {self.max_num_seqs}: every running sequence decodes "
                           "one token per step")
        if is_hub_uri(self.model):
            parse_uri(self.model)  # a malformed hf:// uri is bad input before anything runs
        if self.tokenizer is not None and is_hub_uri(model_reference(self.tokenizer)):
            # here, not at load: plan and the pod's pre-flight refuse what serve would
            raise BadInput(f"--tokenizer {self.tokenizer}: kvledger reads a tokenizer from a "
                           f"folder; fetch the hub repo first (kvledger fetch --model "
                           f"{self.tokenizer}) and pass its snapshot folder")
        if self.priority_headroom and self.scheduling_policy != "priority":
            raise BadInput("--priority-headroom needs --scheduling-policy priority: under fcfs "
                           "every request has priority 0")

    @property
    def weight_reading(self) -> WeightReading:
        """How the checkpoint's files are read (``checkpoint/read_ahead.py``)."""
        return WeightReading(self.safetensors_load_strategy,
                             self.safetensors_prefetch_num_threads,
                             self.safetensors_prefetch_block_size)
