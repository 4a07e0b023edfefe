"""The operator's reconcile time and memory: ``kvledger operator`` in its own process (as its
pod runs it) against kmock's Kubernetes emulator over HTTP (tests/operator_harness.py).

N InferenceServices are created at once; the time until every one's Deployment, Service and
status are there is the create reconcile; then each spec is edited (``engine.maxNumSeqs``)
and the time until every Deployment carries the new flag is the update reconcile. Both are
given as wall time and as the operator process's own CPU time per service (the emulator
runs in this process, on the same cores: the wall time is mostly its). The operator's
resident memory is read from /proc before the first resource (idle), after the last
(steady) and at its peak (VmHWM).

    python bench/operator_reconcile.py [--services 20] [--label after] [--out FILE.json]

Exit 1 when a resource is not reconciled within the deadline (120 s a round).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from operator_harness import emulated_cluster, service_manifest  # noqa: E402

from kvledger.operator.api.resource import API_VERSION, PLURAL  # noqa: E402

NS = "default"
DEADLINE_S = 120.0


def cpu_s(pid: int) -> float:
    """The process's user + system CPU seconds so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_kib(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


async def until(check, deadline_s: float = DEADLINE_S) -> float:
    """Seconds until ``check()`` holds, asked every 50 ms (the emulator shares this
    process: a busier poll would slow the API server it measures)."""
    begun = time.monotonic()
    while not check():
        if time.monotonic() - begun > deadline_s:
            raise TimeoutError
        await asyncio.sleep(0.05)
    return time.monotonic() - begun


def stored(cluster, api_version: str, plural: str) -> dict[str, dict]:
    """Every live object of one collection in NS, by name, in one pass over the emulator."""
    out = {}
    for (resource, ns, name), obj in list(cluster.emulator.objects.items()):
        if (ns == NS and resource.plural == plural and not obj.deleted
                and f"{resource.group}/{resource.version}".lstrip("/") == api_version):
            out[name] = obj.raw
    return out


async def measure(services: int) -> dict:
    async with emulated_cluster() as cluster:
        env = {**os.environ, "KUBECONFIG": cluster.kubeconfig, "KVLEDGER_POLICY": "{}"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvledger.engine.cli", "operator", "--namespace", NS],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            names = [f"svc-{i:03d}" for i in range(services)]
            warm = "warm-up"
            await cluster.create(API_VERSION, PLURAL, service_manifest(warm, NS))
            await until(lambda: cluster.stored("apps/v1", "deployments", NS, warm))
            await asyncio.sleep(1.0)
            idle = memory_kib(proc.pid)

            def reconciled() -> bool:
                deployments = stored(cluster, "apps/v1", "deployments")
                services = stored(cluster, "v1", "services")
                owners = stored(cluster, API_VERSION, PLURAL)
                return all(n in deployments and n in services
                           and (owners.get(n) or {}).get("status") for n in names)

            cpu = cpu_s(proc.pid)
            begun = time.monotonic()
            await asyncio.gather(*(cluster.create(API_VERSION, PLURAL, service_manifest(n, NS))
                                   for n in names))
            create_s = time.monotonic() - begun + await until(reconciled)
            create_cpu = cpu_s(proc.pid) - cpu
            cpu = cpu_s(proc.pid)

            def flagged() -> bool:
                deployments = stored(cluster, "apps/v1", "deployments")
                for n in names:
                    body = deployments[n]
                    args = body["spec"]["template"]["spec"]["containers"][0].get("args") or []
                    if "--max-num-seqs" not in args or args[args.index("--max-num-seqs") + 1] != "7":
                        return False
                return True

            begun = time.monotonic()
            await asyncio.gather(*(cluster.patch(API_VERSION, PLURAL, NS, n,
                                                 {"spec": {"engine": {"maxNumSeqs": 7}}},
                                                 bump_generation=True)
                                   for n in names))
            update_s = time.monotonic() - begun + await until(flagged)
            update_cpu = cpu_s(proc.pid) - cpu
            await asyncio.sleep(1.0)
            steady = memory_kib(proc.pid)
            requests = len(cluster.emulator.asked)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return {"services": services, "create_s": round(create_s, 3),
            "create_ms_per_service": round(1000 * create_s / services, 1),
            "create_cpu_ms_per_service": round(1000 * create_cpu / services, 1),
            "update_s": round(update_s, 3),
            "update_ms_per_service": round(1000 * update_s / services, 1),
            "update_cpu_ms_per_service": round(1000 * update_cpu / services, 1),
            "rss_idle_mib": round(idle["VmRSS"] / 1024, 1),
            "rss_steady_mib": round(steady["VmRSS"] / 1024, 1),
            "rss_peak_mib": round(steady["VmHWM"] / 1024, 1),
            "api_requests": requests}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", type=int, default=20)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--label", default="")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    runs = []
    for _ in range(args.runs):
        try:
            runs.append(asyncio.run(measure(args.services)))
        except TimeoutError:
            print(f"FAIL: not every resource reconciled within {DEADLINE_S:.0f} s")
            return 1
    summary = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    result = {"label": args.label, "median": summary, "runs": runs}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
