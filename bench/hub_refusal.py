"""Refusing a 70B-class model on the hub: the bytes and seconds it costs, against downloading it.

Serves bench/plan_speed.py's Llama-3-70B-shaped bf16 checkpoint (30 sparse shards, 131.4
GiB of tensors) from tests/hub_server.py, a hub-compatible endpoint on 127.0.0.1, and plans
``hf://`` of it on a 192 GiB card with 64 sequences of 8192 tokens, which does not fit.
In the same run it times:

  ours      the refusal in-process: the revision resolved, config.json and the index read,
            each shard's header fetched with Range requests, the plan and its remedies
  baseline  downloading the weights from the same endpoint: a GET of 512 MiB of one shard,
            scaled to the checkpoint (loopback, so any real network is slower)

and prints the best time of each, the bytes the server sent for the refusal (counted on the
server) against the checkpoint's size, and the ratios; then ``kvledger plan`` end to end as a
subprocess (interpreter start and imports included), exit 3.

    .venv/bin/python bench/hub_refusal.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "bench")]

from hub_server import HubServer  # noqa: E402
from plan_speed import best_seconds, write_sparse_checkpoint  # noqa: E402

GiB = 2**30
MiB = 2**20
REPO = "kvledger-bench/llama-3-70b-sparse"
FLAGS = ["--device-memory", "192GiB", "--max-model-len", "8192", "--max-num-seqs", "64"]
BASELINE_BYTES = 512 * MiB


def refuse(uri: str, endpoint: str):
    from kvledger.engine.checkpoint.hub.headers import header_mirror
    from kvledger.engine.planner.plan import make_plan
    from kvledger.engine.settings.config import EngineConfig

    config = EngineConfig(model=uri, device_memory_bytes=192 * GiB, max_model_len=8192,
                          max_num_seqs=64)
    with header_mirror(uri, endpoint=endpoint) as source:
        return make_plan(config, source=source)


def download_some(hub: HubServer, shard: str) -> int:
    """GET the first BASELINE_BYTES of one shard, as a download would."""
    from huggingface_hub import get_session

    url = f"{hub.url}/{REPO}/resolve/main/{shard}"
    headers = {"Range": f"bytes=0-{BASELINE_BYTES - 1}"}
    got = 0
    with get_session().stream("GET", url, headers=headers, timeout=60) as response:
        for chunk in response.iter_bytes(1 << 20):
            got += len(chunk)
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, HubServer() as hub:
        folder = Path(tmp) / "repo"
        folder.mkdir()
        total = write_sparse_checkpoint(folder, 30)
        hub.add_commit(REPO, folder)
        os.environ["HF_ENDPOINT"] = hub.url  # read by huggingface_hub at import (below)
        os.environ["HF_HOME"] = str(Path(tmp) / "hf-home")
        from huggingface_hub import constants
        constants.ENDPOINT = hub.url
        uri = f"hf://{REPO}"
        checkpoint_bytes = sum(p.stat().st_size for p in folder.iterdir())

        refuse(uri, hub.url)  # warm: imports, connections
        hub.served.clear()
        ours_s, plan = best_seconds(lambda: refuse(uri, hub.url), args.repeat)
        assert not plan.fits and plan.remedies, "the 70B plan should be refused with remedies"
        sent = hub.served_bytes(REPO) // args.repeat
        shard = "model-00002-of-00030.safetensors"
        base_s, got = best_seconds(lambda: download_some(hub, shard), max(1, args.repeat // 2))
        assert got == BASELINE_BYTES, got
        download_s = base_s * checkpoint_bytes / BASELINE_BYTES

        hub.served.clear()
        t0 = time.perf_counter()
        cli = subprocess.run([sys.executable, "-m", "kvledger.engine.cli", "plan", "--model", uri,
                              *FLAGS], capture_output=True, text=True, env=os.environ | {
                                  "HF_ENDPOINT": hub.url}, timeout=120)
        cli_s = time.perf_counter() - t0
        assert cli.returncode == 3, cli.stderr
        print(f"checkpoint: {REPO}, 30 shards, {total / GiB:.1f} GiB of tensors "
              f"({checkpoint_bytes} bytes), served by a local hub endpoint")
        print(f"refusal (ours):  {ours_s:6.3f} s, {sent} bytes ({sent / 2**20:.1f} MiB) sent by "
              f"the server = {sent / checkpoint_bytes:.2e} of the checkpoint")
        print(f"download (baseline, {BASELINE_BYTES // MiB} MiB scaled): {download_s:7.1f} s "
              f"({BASELINE_BYTES / base_s / GiB:.2f} GiB/s)   ratio baseline/ours "
              f"{download_s / ours_s:.0f}x")
        print(f"kvledger plan end to end (subprocess): {cli_s:.2f} s, exit {cli.returncode}, "
              f"{hub.served_bytes(REPO) / 1024:.0f} KiB sent")


if __name__ == "__main__":
    main()
