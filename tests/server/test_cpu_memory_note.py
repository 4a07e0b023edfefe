"""``--gpu-memory-utilization`` on the CPU keeps vLLM's meaning (a fraction of the device's
total, here the host's RAM, the KV pool taking what the run leaves), which on a host is
many GiB allocated before ``/ready`` (0.5 took 11.8 GiB of KV and 2 min 13 s on a 24 GiB
machine, issue 52). The start-up log says how much it takes and how to cap it, as vLLM's
CPU build documents VLLM_CPU_KVCACHE_SPACE."""

from __future__ import annotations

import re
import subprocess
import sys

from _server_helpers import free_port, reap, wait_for_serve

# The host as a 3 GiB container sees it, so the pool stays small on any machine.
HOST = ["--device", "cpu", "--container-memory-limit", "3GiB", "--max-model-len", "256"]
NOTE = re.compile(r"--gpu-memory-utilization 0\.3 on the CPU is 30% of this host's memory "
                  r"\(0\.9 GiB of 3\.0 GiB\): the KV pool takes (\d+\.\d) GiB of it, allocated "
                  r"now; to take less, cap the pool with --kv-cache-memory-bytes SIZE \(what "
                  r"vLLM's CPU build sets with VLLM_CPU_KVCACHE_SPACE\) or the whole engine "
                  r"with --memory-limit SIZE")


def _startup_log(model_dir, *flags: str) -> str:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvledger.engine.cli", "serve",
                             str(model_dir), *HOST, *flags, "--host", "127.0.0.1", "--port",
                             str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        wait_for_serve(proc, port)
        proc.terminate()
        return proc.communicate(timeout=60)[1]
    finally:
        reap(proc)


def test_the_cpu_start_up_says_what_the_utilization_takes(tiny_llama_dir) -> None:
    err = _startup_log(tiny_llama_dir, "--gpu-memory-utilization", "0.3")
    note = NOTE.search(err)
    assert note is not None, err
    pool = re.search(r"KV pool: \d+ blocks x \d+ tokens \((\d+) bytes\)", err)
    assert f"{int(pool.group(1)) / 2**30:.1f}" == note.group(1)
    assert err.index("on the CPU is 30%") < pool.start()  # said before it is allocated


def test_no_note_when_the_pool_is_sized_otherwise(tiny_llama_dir) -> None:
    err = _startup_log(tiny_llama_dir, "--gpu-memory-utilization", "0.3",
                       "--kv-cache-memory-bytes", "4MiB")
    assert "KV pool:" in err and "on the CPU is" not in err
