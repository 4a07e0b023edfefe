"""Figures the docs state about the code are computed from it, so they cannot drift: the
share of vLLM's flags taken, refused and accepted as no-ops (docs/coming-from-vllm.md,
as ``scripts/vllm_flag_share.py`` prints it); the size of the test suite is not stated
in prose at all (``pytest --collect-only`` says it)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from kvledger.engine.cli import build_parser
from kvledger.engine.vllm_flags import verdicts

ROOT = Path(__file__).parent.parent


def test_the_vllm_flag_counts_are_the_parsers() -> None:
    text = " ".join((ROOT / "docs" / "coming-from-vllm.md").read_text().split())
    stated = re.search(r"Of vLLM 0\.32's (\d+) `vllm serve` flags, (\d+) are implemented, "
                       r"(\d+) are accepted because they change nothing here .*?, and (\d+) "
                       r"are refused by name", text)
    assert stated is not None
    counts = Counter(verdicts(build_parser("serve")).values())
    assert tuple(map(int, stated.groups())) == (
        sum(counts.values()), counts["implemented"], counts["no-op"], counts["refused"])


def test_no_doc_states_how_many_tests_the_suite_has() -> None:
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        found = re.findall(r"about [\d,]+ tests|[\d,]{4,} tests", path.read_text())
        assert found == [], path.name
