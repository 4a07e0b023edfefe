"""lm-evaluation-harness (``lm-eval``) as a client of the server, on two tiny local tasks.

``write_tasks(folder)`` writes two task YAMLs and their jsonl data into ``folder``, so
lm-eval needs no Hugging Face hub (``dataset_path: json`` reads the local files):

- ``kvledger_mc``: ``multiple_choice`` (metric ``acc``). lm-eval scores each choice as a
  *loglikelihood* request: ``/v1/completions`` with ``echo: true, logprobs: 1,
  max_tokens: 1`` and the prompt as token ids, then sums the echoed prompt logprobs of
  the choice's tokens.
- ``kvledger_gen``: ``generate_until`` (metric ``exact_match``), greedy, ``until: ["\\n"]``,
  8 tokens at most: plain completions (or chat completions with a chat template).

``run_lm_eval(...)`` runs lm-eval on them in a subprocess (``python -c`` calling
``lm_eval.simple_evaluate``) and returns ``results["results"]``, e.g.
``{"kvledger_mc": {"acc,none": 0.5, ...}, "kvledger_gen": {"exact_match,none": 0.0, ...}}``,
each task's entry with a ``samples`` list added: per document, in order, its
``arguments`` (``[context, continuation]`` per choice, or ``[prompt, gen_kwargs]``), its
``target`` and lm-eval's answers ``filtered_resps`` (``[loglikelihood, is_greedy]`` per
choice, or the generated text), so a test can check the numbers, not only the metric.
A subprocess because lm-eval's HTTP client blocks (``requests``) while a test's server
runs on the test's event loop, because it must run with the hub offline
(``HF_*_OFFLINE``, read at import time, would leak into the rest of the pytest process),
and because ``simple_evaluate`` reseeds the global random, numpy and torch generators.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

MC_TASK = "kvledger_mc"
GEN_TASK = "kvledger_gen"

MC_DOCS = [
    {"question": "What colour is the sky on a clear day?", "choices": ["blue", "green", "red"],
     "answer": 0},
    {"question": "How many legs does a cat have?", "choices": ["two", "four"], "answer": 1},
    {"question": "Which animal barks?", "choices": ["cat", "dog", "fish"], "answer": 1},
    {"question": "What is the opposite of hot?", "choices": ["cold", "warm"], "answer": 0},
]
GEN_DOCS = [
    {"prompt": "Once upon a time", "answer": " there"},
    {"prompt": "The capital of France is", "answer": " Paris"},
    {"prompt": "1, 2, 3,", "answer": " 4"},
]

# Only keys lm-eval consumes itself (until, max_gen_toks, do_sample, temperature): any
# other generation_kwargs key is forwarded verbatim into the request body.
_DATASET_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
"""
_MC_YAML = _DATASET_YAML + """\
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
_GEN_YAML = _DATASET_YAML + """\
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def write_tasks(folder: Path) -> dict[str, str]:
    """Write ``kvledger_mc`` and ``kvledger_gen`` (YAML + jsonl) into ``folder``, plus a
    ``datasets`` cache folder inside it; return ``{"loglikelihood": ..., "generate": ...}``."""
    folder.mkdir(parents=True, exist_ok=True)
    cache = folder / "datasets-cache"
    for task, docs, template in ((MC_TASK, MC_DOCS, _MC_YAML), (GEN_TASK, GEN_DOCS, _GEN_YAML)):
        data = folder / f"{task}.jsonl"
        data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
        (folder / f"{task}.yaml").write_text(
            template.format(task=task, data=json.dumps(str(data)), cache=json.dumps(str(cache))))
    return {"loglikelihood": MC_TASK, "generate": GEN_TASK}


_SCRIPT = """\
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager
args = json.loads(sys.argv[1])
out = lm_eval.simple_evaluate(
    model=args["model"], model_args=args["model_args"], tasks=args["tasks"],
    task_manager=TaskManager(include_path=args["include_path"], include_defaults=False),
    apply_chat_template=args["chat"], bootstrap_iters=0, log_samples=True)
for task, samples in out["samples"].items():
    out["results"][task]["samples"] = [
        {key: s[key] for key in ("doc_id", "arguments", "target", "filtered_resps")}
        for s in sorted(samples, key=lambda s: s["doc_id"])]
print("LM_EVAL_RESULTS " + json.dumps(out["results"], default=str))
"""


def run_lm_eval(base_url: str, model: str, model_dir: Path, tasks: list[str],
                include_path: Path, chat: bool, api_key: str = "",
                timeout_s: float = 240.0) -> dict:
    """Run lm-eval's ``local-chat-completions`` (``chat``) or ``local-completions`` model
    against the server at ``base_url`` (``http://host:port``) on ``tasks`` found under
    ``include_path``; return lm-eval's ``results`` dict (per task, ``"metric,filter"`` keys).

    ``local-completions`` tokenizes with the checkpoint's own tokenizer (``model_dir``, read
    by transformers' AutoTokenizer) and sends token ids: loglikelihood needs the context
    length in tokens, and ids make the server score exactly the tokens lm-eval counts.
    ``local-chat-completions`` sends messages and needs no tokenizer. Retries are off, so
    a refused request fails the run instead of being retried three times. lm-eval sends
    ``Authorization: Bearer $OPENAI_API_KEY``, so ``api_key`` goes there. It runs in
    ``include_path``, as ``simple_evaluate`` calls ``git describe`` in its working folder.
    """
    if chat:
        lm = "local-chat-completions"
        model_args = {"base_url": f"{base_url}/v1/chat/completions", "model": model,
                      "max_retries": 1, "timeout": 60}
    else:
        # max_length: lm-eval left-truncates prompts to max_length - 1 tokens (+1 generated);
        # its default, 2048, is past the tests' max_model_len (256).
        lm = "local-completions"
        model_args = {"base_url": f"{base_url}/v1/completions", "model": model,
                      "tokenizer_backend": "huggingface", "tokenizer": str(model_dir),
                      "max_length": 256, "max_retries": 1, "timeout": 60}
    args = {"model": lm, "model_args": model_args, "tasks": tasks,
            "include_path": str(include_path), "chat": chat}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
           "TOKENIZERS_PARALLELISM": "false", "OPENAI_API_KEY": api_key}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(args)], env=env,
                          cwd=include_path, capture_output=True, text=True, timeout=timeout_s)
    for line in proc.stdout.splitlines():
        if line.startswith("LM_EVAL_RESULTS "):
            return json.loads(line.removeprefix("LM_EVAL_RESULTS "))
    raise AssertionError(f"lm-eval failed ({proc.returncode}):\n{proc.stderr[-4000:]}")

