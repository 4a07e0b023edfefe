"""docs/operator.md's table of the CRD's spec fields ("The CRD") against the schema the
operator serves: every field the resource takes is in the table, and every field the table
names is one the resource takes. The table was checked by nothing, and a field added to
the CRD (or renamed) left it wrong."""

from __future__ import annotations

import re
from pathlib import Path

from kvledger.operator.api.crd import openapi_schema

ROOT = Path(__file__).resolve().parents[3]
# kvledger's own sections, whose every field the table names one by one (the others, such
# as affinity or env, are Kubernetes' types, named as a whole).
OWN_SECTIONS = ("model", "engine", "memory", "tools", "autoscaling")


def table_rows() -> list[str]:
    """The first cells of the table under "## The CRD"."""
    text = (ROOT / "docs" / "operator.md").read_text()
    section = text[text.index("## The CRD"):]
    rows = section[section.index("| spec | flag / effect |"):].split("\n\n", 1)[0]
    return [line.split(" | ")[0].removeprefix("| ") for line in rows.splitlines()[2:]]


def named_fields(cell: str) -> set[str]:
    """The field paths a cell names: each backticked ``a.b``, ``a.{b, c (default)}`` or
    ``a.{b | c.d}`` expanded; a value in backticks (``fp8``, ``40Gi``) names nothing."""
    fields = set()
    for quoted in re.findall(r"`([^`]+)`", cell.replace("\\|", "|")):
        head, brace, rest = quoted.partition(".{")
        if brace:
            inner = re.sub(r"\([^)]*\)", "", rest.rsplit("}", 1)[0])
            for part in re.split(r"[,|]", inner):
                fields.add(f"{head}.{part.strip()}")
        elif re.fullmatch(r"[a-z][A-Za-z]*(\.[a-z][A-Za-z]*)*",
                          word := quoted.split(" ")[0].rstrip(":")):
            fields.add(word)  # `adapters: [{name, uri}]` names adapters
    return fields


def test_the_crd_table_names_every_spec_field_and_no_other() -> None:
    spec = openapi_schema()["properties"]["spec"]["properties"]
    documented = set().union(*map(named_fields, table_rows()))
    heads = {path.split(".")[0] for path in documented}
    assert set(spec) - heads == set(), "spec fields the table does not name"
    named = documented | {".".join(path.split(".")[:2]) for path in documented}
    for section in OWN_SECTIONS:
        missing = {f"{section}.{field}" for field in spec[section]["properties"]} - named
        assert missing == set(), f"{section}'s fields the table does not name"
    unknown = set()
    for path in documented:
        head, *rest = path.split(".")
        if head not in spec:
            if "." in path:  # a bare word may be a value (`fp8`); a path must be a field
                unknown.add(path)
            continue
        if rest and "properties" in spec[head] and rest[0] not in spec[head]["properties"]:
            unknown.add(path)
    assert unknown == set(), "the table names fields the resource does not take"


def test_a_field_left_out_or_made_up_is_caught() -> None:
    """The parsing the test above relies on: braces, defaults in parentheses, `|`."""
    assert named_fields("`autoscaling.{minReplicas (1), metric (kvReservedRatio)}`") == {
        "autoscaling.minReplicas", "autoscaling.metric"}
    assert named_fields("`model.volume.{persistentVolumeClaim.claimName \\| hostPath.path}`, "
                        "`mountPath` (`/models`)") == {
        "model.volume.persistentVolumeClaim.claimName", "model.volume.hostPath.path",
        "mountPath"}
    assert named_fields("`engine.quantization` (`fp8`), `adapters: [{name, uri}]`") == {
        "engine.quantization", "adapters"}
