#!/usr/bin/env bash
# The engine's CUDA checks in ONE bounded run (a few minutes; the step limits add up to
# 9.2 minutes) on a GPU machine with no internet, this repo copied, maybe no venv:
#
#     bash bench/gpu_checks.sh 2>&1 | tee gpu_checks.log
#
# With this workplace's device tool: first `bash bench/gpu_wheels.sh` here (the image has no
# pydantic, which `kvledger serve` needs), then run(command="bash bench/gpu_checks.sh 2>&1 |
# tee $OUT/gpu_checks.log", timeout_s=590, carry=[".whl"]).
#
# (a) Python: the repo's .venv when its torch sees CUDA, else the machine's python3 and
#     its torch; kvledger is imported from this tree (no install). Wheels of anything
#     missing can be carried in .whl/ and are installed into /tmp/site first.
# (b) bench/gpu_memory_check.py: planner-predicted vs measured bytes per class,
#     tiny-llama and small-llama in bfloat16 (and small-llama with an fp8 KV cache); a
#     class over the pre-load plan, or a peak over either plan, fails the step.
# (c) the greedy-equality tests against transformers on CUDA (float32), the meta-device
#     runner tests, seeded / greedy sampling in bf16 with bf16 and fp8 KV, and which
#     SDPA kernels (flash, efficient, cuDNN, math) take the engine's attention shapes.
# (d) `kvledger plan` against the real device through NVML.
# (e) bench/gpu_oom_check.py: a real out-of-memory while requests run (another allocation
#     takes the device's free memory): that step's requests fail, the rest complete.
# Every step is time-limited and reports its exit status; the script goes on after a
# failure, names every failed step in its last lines and exits non-zero if any failed.
#
# `bash bench/gpu_checks.sh speed` (step limits 9.3 minutes) runs (a), then the paged
# attention kernels' (decodes, later prompt chunks) and the CUDA graphs' tests compiled on
# the GPU, then
# bench/gpu_speed.py, its JSON written to $OUT/gpu_speed.json (commit it under bench/results/).
# `bash bench/gpu_checks.sh load` (about 5 minutes) runs (a), then bench/weight_readers.py on
# CUDA, the checkpoint in 8 shards (the engine's load lazy, prefetched and eager beside the
# libraries): its JSON written to $OUT/weight_readers-cuda.json (the libraries come as wheels from
# bench/gpu_wheels.sh; cold only where the run may drop the page cache).
# `bash bench/gpu_checks.sh serving` (a second call, about 5 minutes) runs (a), then only
# bench/serving.py with kvledger on CUDA: part 1 at concurrency 1, 3, 8, 32 and one
# overload round (vLLM too when a CUDA build of it is on PATH; otherwise kvledger alone).
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
failed=()  # "DESCRIPTION: exit RC" of each failed step
step() {  # step SECONDS DESCRIPTION COMMAND...
    local limit=$1 what=$2
    shift 2
    echo
    echo "=== $what"
    local start=$SECONDS
    timeout "$limit" "$@"
    local rc=$?
    echo "=== $what: exit $rc in $((SECONDS - start)) s"
    if [ "$rc" -eq 124 ]; then
        failed+=("$what: timed out after $limit s")
    elif [ "$rc" -ne 0 ]; then
        failed+=("$what: exit $rc")
    fi
}

# (a) ---------------------------------------------------------------------------------
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
PY=python3
if [ -x .venv/bin/python ] && .venv/bin/python -c \
        'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    PY=.venv/bin/python
fi
if ! "$PY" -c 'import kvledger.engine' 2>/dev/null; then
    # kvledger.engine and kvledger.operator are the top-level folders (pyproject's
    # package-dir): a namespace package of links makes them importable as installed.
    mkdir -p /tmp/kvl-src/kvledger
    ln -sfn "$PWD/engine" /tmp/kvl-src/kvledger/engine
    ln -sfn "$PWD/operator" /tmp/kvl-src/kvledger/operator
    export PYTHONPATH=/tmp/kvl-src${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv || true
timeout 60 "$PY" - <<'EOF' || exit 2
import importlib, sys
import torch
print(f"python {sys.version.split()[0]} ({sys.executable}); torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}, device: "
      f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'NONE'}")
missing = []
for name in ("safetensors", "tokenizers", "jinja2", "pynvml", "aiohttp", "pydantic",
             "prometheus_client", "pytest", "transformers"):
    try:
        module = importlib.import_module(name)
        print(f"  {name} {getattr(module, '__version__', '?')}")
    except ImportError:
        missing.append(name)
if missing:
    print(f"  missing: {', '.join(missing)} (carry wheels in .whl/: bench/gpu_wheels.sh)")
import kvledger.engine  # noqa: F401  (fails here if the tree cannot be imported)
if not torch.cuda.is_available():
    sys.exit("error: torch sees no CUDA device")
EOF

finish() {  # the last lines: every failed step named; exit status 1 if any failed
    echo
    if [ "${#failed[@]}" -eq 0 ]; then
        echo "=== all GPU checks passed"
        exit 0
    fi
    echo "=== ${#failed[@]} GPU check(s) FAILED:"
    printf '===   %s\n' "${failed[@]}"
    exit 1
}

if [ "${1:-}" = speed ]; then  # the GPU path: its tests compiled, then bench/gpu_speed.py
    step 120 "the paged kernels (decodes, later chunks) compiled against SDPA; greedy tokens of both attention paths, and of captured graphs against eager (float32)" \
        env TRITON_INTERPRET=0 KVLEDGER_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider \
        -o addopts="" tests/engine/model/test_paged_attention.py tests/engine/model/test_prefill_attention.py \
        tests/engine/core/test_paged_engine.py
    step 440 "bench/gpu_speed.py: decode, prefill and a later chunk against the card's own limits" \
        "$PY" bench/gpu_speed.py --out "${OUT:-bench/results}/gpu_speed.json"
    finish
fi

if [ "${1:-}" = load ]; then  # the weights' read: kvledger's reader against the libraries
    # 8 ways x (cold, a warming read, warm) x 2 rounds: 48 processes, each importing torch
    step 420 "bench/weight_readers.py: a 1.45 GB checkpoint in 8 shards to the GPU, kvledger (default, lazy, prefetch, eager) against fastsafetensors and runai-model-streamer, cold and warm" \
        "$PY" bench/weight_readers.py --device cuda --rounds 2 --shards 8 \
        --json "${OUT:-bench/results}/weight_readers-cuda.json"
    finish
fi

if [ "${1:-}" = serving ]; then
    step 330 "bench/serving.py, kvledger on CUDA" "$PY" bench/serving.py --device cuda \
        --concurrency 1 3 8 32 --rounds 1 --overload-rounds 1
    finish
fi

# (b) ---------------------------------------------------------------------------------
step 60 "gpu_memory_check tiny-llama bf16" \
    "$PY" bench/gpu_memory_check.py --model tiny-llama --dtype bfloat16
step 90 "gpu_memory_check small-llama bf16" \
    "$PY" bench/gpu_memory_check.py --model small-llama --dtype bfloat16
step 90 "gpu_memory_check small-llama bf16, fp8 KV, 64 x 2048, 4096-token steps" \
    "$PY" bench/gpu_memory_check.py --model small-llama --dtype bfloat16 --kv-cache-dtype fp8 \
    --max-model-len 2048 --max-num-seqs 64 --max-num-batched-tokens 4096

# (c) ---------------------------------------------------------------------------------
step 150 "engine tests on CUDA: greedy equality vs transformers (float32), meta-device runner" \
    env KVLEDGER_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider -o addopts="" \
    tests/engine/model/test_hf_equivalence.py tests/engine/core/test_device_paths.py
step 50 "seeded and greedy sampling on CUDA, bf16 weights, bf16 and fp8 KV" "$PY" - <<'EOF'
import tempfile

from kvledger.engine import LLM, SamplingParams
from kvledger.engine.model.builtin import write_model

model_dir = str(write_model("tiny-llama", tempfile.mkdtemp()))
for kv in ("auto", "fp8"):
    llm = LLM(model_dir, max_model_len=256, max_num_seqs=8, device="cuda", dtype="bfloat16",
              kv_cache_dtype=kv)
    seeded = [SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=i, max_tokens=24)
              for i in range(6)]
    prompts = [[5, 6, 7, 8 + i] for i in range(6)]
    first = [o.token_ids for o in llm.generate(prompts, seeded)]
    again = [o.token_ids for o in llm.generate(prompts, seeded)]
    # Other batch mates change the kernels' shapes, so bf16 logits may differ slightly:
    # reported, not asserted.
    fewer = [o.token_ids for o in llm.generate(prompts[:3], seeded[:3])]
    greedy = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=24))[0].token_ids
    print(f"KV {kv}: seeded run repeats: {first == again}; the same with 3 of the 6 in the "
          f"batch: {first[:3] == fewer}; greedy {greedy}")
    assert first == again
    del llm
EOF

step 30 "which SDPA kernels take the engine's attention shapes (bf16, GQA 8/4)" "$PY" - <<'EOF'
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

warnings.simplefilter("ignore")
r = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)  # noqa: E731
mask = lambda *shape: torch.ones(*shape, device="cuda", dtype=torch.bool)  # noqa: E731
shapes = {  # name: (q, k, v, kwargs), as model.Attention calls it
    "first chunk, causal": (r(1, 8, 512, 64), r(1, 4, 512, 64), r(1, 4, 512, 64),
                            {"is_causal": True, "enable_gqa": True}),
    "first chunk, window mask": (r(1, 8, 512, 64), r(1, 4, 512, 64), r(1, 4, 512, 64),
                                 {"attn_mask": mask(512, 512).tril(), "enable_gqa": True}),
    "later chunk, mask": (r(1, 8, 256, 64), r(1, 4, 1024, 64), r(1, 4, 1024, 64),
                          {"attn_mask": mask(1, 1, 256, 1024).tril(768), "enable_gqa": True}),
    "decode, heads folded": (r(32, 4, 2, 64), r(32, 4, 1024, 64), r(32, 4, 1024, 64),
                             {"attn_mask": mask(32, 1, 1, 1024)}),
}
backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
            SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]
for name, (q, k, v, kwargs) in shapes.items():
    runs = []
    for backend in backends:
        try:
            with sdpa_kernel([backend]):
                F.scaled_dot_product_attention(q, k, v, **kwargs)
            runs.append(backend.name)
        except RuntimeError:
            pass
    print(f"{name:<28} runs on: {', '.join(runs)}")
EOF

# (d) ---------------------------------------------------------------------------------
models=$(mktemp -d)
timeout 60 "$PY" -m kvledger.engine.cli make-model small-llama "$models/small-llama" >/dev/null
step 20 "kvledger plan on this GPU (NVML)" \
    "$PY" -m kvledger.engine.cli plan --model "$models/small-llama" --device cuda \
    --dtype bfloat16 --max-model-len 2048 --max-num-seqs 256
step 20 "kvledger plan on this GPU (NVML), --gpu-memory-utilization 0.9, JSON" \
    "$PY" -m kvledger.engine.cli plan --model "$models/small-llama" --device cuda \
    --dtype bfloat16 --gpu-memory-utilization 0.9 --json
rm -rf "$models"

# (e) ---------------------------------------------------------------------------------
step 40 "a real out-of-memory on CUDA while requests run" "$PY" bench/gpu_oom_check.py
finish
