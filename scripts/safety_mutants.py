"""Do the safe-admission tests catch the bugs that matter? Plant each known mutant of the
safety check, the ledger and the scheduler in the checkout, run the tests of that room,
and put the file back: every mutant must fail at least one test.

    .venv/bin/python scripts/safety_mutants.py [NAME ...]

The mutants: the four a review planted by hand (a margin off by one, shared blocks
returned with each holder, a choice's awaited prompt blocks left out of its need, an
admission while a request is paused) and those of the progress guarantee (the head not
run first, LoRA slots left out of the check, seats and slots not waited for in the
check's order, a stale "held with another" in the projection, a paused prompt chunk
holding the step's token budget, a choice awaiting its prompt stopping the line). Prints one line per mutant
(killed, by which test, or SURVIVED); exit status 1 when any survived. It edits files in
place (restored in ``finally``): run it on a clean tree, not beside other work.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ["tests/engine/kv/test_banker.py", "tests/engine/kv/test_safe_admission.py",
         "tests/engine/kv/test_safe_progress.py",
         "tests/engine/kv/test_ledger.py", "tests/engine/kv/test_prompt_share.py",
         "tests/engine/kv/test_prefix_cache.py"]

# name -> (file, text, replacement): each text occurs exactly once.
MUTANTS = {
    "margin off by one": (
        "engine/kv/safety.py", "self._spent < self._slack", "self._spent <= self._slack"),
    "shared blocks returned with each holder": (
        "engine/kv/banker.py", "available += claim.fresh + len(claim.blocks) - len(key)",
        "available += claim.fresh + len(claim.blocks)"),
    "awaited prompt blocks left out of the need": (
        "engine/kv/safety.py", "return reservation.draws_left + reservation.awaited_blocks",
        "return reservation.draws_left"),
    "admit while a request is paused": (
        "engine/kv/safety.py", "        if self.paused:\n            self.refusal",
        "        if False:\n            self.refusal"),
    "the head not run first": (
        "engine/core/scheduler.py", "        head = self._seat_head()\n",
        "        head = None\n"),
    "LoRA slots left out of the check": (
        "engine/kv/safety.py", "shared, seats=self.max_live, slots=self.max_adapters)",
        "shared, seats=self.max_live, slots=None)"),
    "a paused chunk holds the token budget": (
        "engine/core/scheduler.py", "        prefills.append(chunk)\n        return chunk.length",
        "        prefills.append(chunk)\n        return budget_tokens"),
    "stale held-with-another in the projection": (
        "engine/kv/safety.py", "        if sharers:\n            self.live[sharers[0]][2] = 0",
        "        if False:\n            self.live[sharers[0]][2] = 0"),
    "seats and slots left out of the check's order": (
        "engine/kv/banker.py", "            if followed and not seating.can_start(claims[index]):",
        "            if False:"),
    "a choice awaiting its prompt stops the line": (
        "engine/core/scheduler.py",
        "            if (seq.reservation.awaits_share  # another choice is computing their prompt\n",
        "            if seq.reservation.awaits_share:\n                passed.append(seq)\n"
        "                break\n"
        "            if (seq.reservation.awaits_share  # another choice is computing their prompt\n"),
}


def run_mutant(name: str) -> str | None:
    """The first test that fails with ``name`` planted, or None if all pass."""
    path, text, replacement = MUTANTS[name]
    file = ROOT / path
    original = file.read_text()
    if original.count(text) != 1:
        raise SystemExit(f"safety_mutants: {name}: the text to mutate is not in {path} once")
    try:
        file.write_text(original.replace(text, replacement))
        result = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p",
                                 "no:cacheprovider", *TESTS], cwd=ROOT, capture_output=True,
                                text=True)
    finally:
        file.write_text(original)
    failed = [line.split(" ", 1)[1].split(" - ")[0] for line in result.stdout.splitlines()
              if line.startswith("FAILED ")]
    return failed[0] if failed else None


def main(argv: list[str]) -> int:
    names = argv or list(MUTANTS)
    unknown = [name for name in names if name not in MUTANTS]
    if unknown:
        print(f"safety_mutants: no mutant named {unknown[0]!r}; one of: {', '.join(MUTANTS)}",
              file=sys.stderr)
        return 2
    survived = 0
    for name in names:
        killer = run_mutant(name)
        survived += killer is None
        print(f"{name}: " + (f"killed by {killer}" if killer else "SURVIVED"), flush=True)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
