"""bench/scale_to_zero_kind.sh, the scale-to-zero end-to-end on kind, run here with kind,
kubectl, helm, docker and curl stubbed (no cluster can be had here): the steps go in the
order the recipe says, and its claims pass and fail on the answers the interceptor gives."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "scale_to_zero_kind.sh"
STARTUP = {"readyAt": "2026-12-06T19:00:05Z", "seconds": {"engine": 3, "total": 4}}

RECORDER = """#!/bin/bash
echo "$(basename "$0") $*" >> "$STUB_LOG"
"""
KUBECTL = RECORDER + """case "$*" in
  *"get pods"*) exit 0;;  # none: the scale to 0 is done at once
  *jsonpath*) cat "$STUB_DIR/startup.json";;
  *port-forward*) exec sleep 60;;
esac
"""
# Each call answers the next line of $STUB_DIR/answers: "CODE SECONDS RETRY_AFTER".
CURL = """#!/bin/bash
while [ $# -gt 0 ]; do case "$1" in -o) out=$2; shift;; -D) headers=$2; shift;; esac; shift; done
line=$(head -n 1 "$STUB_DIR/answers"); [ "$(wc -l < "$STUB_DIR/answers")" -gt 1 ] && sed -i 1d "$STUB_DIR/answers"
read -r code seconds retry <<< "$line"
echo "curl $code" >> "$STUB_LOG"
if [ "$code" = 200 ]; then echo '{"choices": [{"text": "hi"}]}' > "$out"
else echo '{"error": {"code": "scaled_to_zero"}}' > "$out"; fi
printf 'HTTP/1.1 %s\\r\\n' "$code" > "$headers"
[ "$retry" != - ] && printf 'Retry-After: %s\\r\\n' "$retry" >> "$headers"
echo "$code $seconds"
"""


def run_recipe(tmp_path: Path, answers: list[str]) -> tuple[int, str, list[str]]:
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, body in {"kind": RECORDER, "helm": RECORDER, "docker": RECORDER,
                       "kvledger": RECORDER, "kubectl": KUBECTL, "curl": CURL}.items():
        path = stubs / name
        path.write_text(body)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "answers").write_text("\n".join(answers) + "\n")
    (tmp_path / "startup.json").write_text(json.dumps(STARTUP))
    log = tmp_path / "log"
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "STUB_DIR": str(tmp_path),
           "STUB_LOG": str(log), "SETTLE_S": "0", "RESULT": str(tmp_path / "result.json"),
           "KVLEDGER": str(stubs / "kvledger")}
    result = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env,
                            timeout=120)
    return result.returncode, result.stdout + result.stderr, log.read_text().splitlines()


def test_the_recipe_runs_its_steps_in_order_and_passes_on_the_answers_it_claims(tmp_path):
    # held: answered after the 4 s start; told: 503 at once, then 503, then 200
    code, out, calls = run_recipe(tmp_path, ["200 5.2 -", "503 0.01 4", "503 0.01 4",
                                             "200 0.3 -"])
    assert code == 0, out
    order = [next(i for i, call in enumerate(calls) if call.startswith(prefix))
             for prefix in ("kvledger make-model tiny-llama", "kind create cluster", "docker build", "kind load image-archive",
                            "helm upgrade --install keda kedacore/keda",
                            "helm upgrade --install http-add-on kedacore/keda-add-ons-http",
                            "helm upgrade --install kvledger charts/kvledger",
                            "kubectl apply -f examples/scale-to-zero.yaml",
                            "kubectl scale kvis/tiny-zero --replicas 0", "curl 200",
                            "kubectl patch kvis/tiny-zero", "curl 503")]
    assert order == sorted(order)
    assert any("policy.hostPaths={/tmp/kvledger-models}" in call for call in calls)
    assert calls[-1].startswith("kind delete cluster")  # nothing left behind
    report = json.loads((tmp_path / "result.json").read_text())
    assert report["pods_before"] == 0
    assert report["hold"]["status"] == 200 and report["hold"]["startup"] == STARTUP
    assert report["retryAfter"]["retry_after"] == "4"
    assert report["retryAfter"]["answered_status"] == 200


@pytest.mark.parametrize(("answers", "failure"), [
    (["200 0.2 -", "503 0.01 4", "200 0.3 -"],
     "hold: waited 0.2 s for a pod that started in 4.0 s"),
    (["200 95 -", "503 0.01 4", "200 0.3 -"],
     "hold: waited 95.0 s for a pod that started in 4.0 s (at most 30 s more allowed)"),
    (["504 300 -", "503 0.01 4", "200 0.3 -"], "hold: answered 504, not 200"),
    (["200 5 -", "200 0.2 -"], "retryAfter: answered 200 in 0.2 s, not 503 at once"),
    (["200 5 -", "503 0.01 60", "200 0.3 -"],
     "retryAfter: Retry-After 60, the start was 4 s"),
])
def test_the_recipe_fails_on_an_answer_it_does_not_claim(tmp_path, answers, failure):
    code, out, _ = run_recipe(tmp_path, answers)
    assert code == 1
    assert f"FAILED: {failure}" in out
