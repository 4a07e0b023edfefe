"""Figures the docs state about the code are computed from it, so they cannot drift: the
share of vLLM's flags taken, refused and accepted as no-ops (docs/coming-from-vllm.md,
as ``scripts/vllm_flag_share.py`` prints it); serve's own flags and their defaults
(docs/serving.md's table, generated from ``ServeConfig`` by ``scripts/serve_flags_table.py``;
the defaults docs/operator.md's CRD table and prose give serve's fields); the size of the
test suite is not stated in prose at all (``pytest --collect-only`` says it)."""

from __future__ import annotations

import importlib.util
import json
import re
from collections import Counter
from pathlib import Path

from kvledger.engine.cli import build_parser
from kvledger.engine.settings.declare import default_of, settings_of
from kvledger.engine.settings.serve_config import ServeConfig
from kvledger.engine.settings.vllm_flags import verdicts

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


def _flags_table_script():
    spec = importlib.util.spec_from_file_location("serve_flags_table",
                                                  ROOT / "scripts" / "serve_flags_table.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_serves_flag_table_is_generated_from_the_declarations() -> None:
    script = _flags_table_script()
    text = (ROOT / "docs" / "serving.md").read_text()
    assert script.with_table(text) == text, "docs/serving.md's serve flags are stale: make docs"


def test_the_defaults_the_docs_give_serves_fields_are_serves() -> None:
    """docs/operator.md's CRD table names each of serve's fields with its default in
    parentheses, where it gives one; the prose that names the line's length gives serve's."""
    operator_md = (ROOT / "docs" / "operator.md").read_text()
    checked = set()
    for f, declared in settings_of(ServeConfig):
        default = default_of(f)
        if declared.crd is None or default is None or default is False:
            continue
        for given in re.findall(rf"`{declared.spec_name}` \(([^)]*)\)", operator_md):
            assert json.dumps(default) in re.split(r"[ ,;]", given), (declared.spec_name, given)
            checked.add(declared.spec_name)
    assert checked == {"port", "shutdownGraceSeconds", "maxQueueLength", "tenantFairness"}
    length = str(ServeConfig.max_queue_len)
    assert re.findall(r"--max-queue-len`, (\d+) unless", operator_md) == [length]
    serving_md = (ROOT / "docs" / "serving.md").read_text()
    assert re.findall(r"at most `--max-queue-len` \((\d+)\)", serving_md) == [length]


def test_a_json_flags_default_is_shown_as_the_json_it_takes() -> None:
    """The table's defaults are what a reader would type: ``--allowed-methods '["*"]'``,
    never Python's ``('*',)``."""
    script = _flags_table_script()
    defaults = {f.name: (default_of(f), declared.kind.metavar)
                for f, declared in settings_of(ServeConfig)}
    lists = {name: default for name, (default, metavar) in defaults.items()
             if metavar == "JSON" and default not in (None, (), {})}
    assert lists, "no JSON flag with a default: the check checks nothing"
    for name, default in lists.items():
        cell = script.shown(default, "JSON")
        # a list flag's, or a config object's own JSON (--structured-outputs-config's {})
        expected = json.loads(default.to_json()) if hasattr(default, "to_json") else list(default)
        assert json.loads(cell.strip("`")) == expected, (name, cell)
