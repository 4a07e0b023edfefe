"""CRDs of what the operator renders for (LeaderWorkerSet, the Gateway API Inference
Extension), vendored unchanged under tests/data below a header naming their release, commit
and git blob: the header and the file read apart, the blob checked, a version's schema made
strict (a field the schema does not name is an error here; the API server would drop it)."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import yaml

from kvledger.operator.api.crd import strict_schema

DATA = Path(__file__).resolve().parent / "data"


def header_and_body(path: Path) -> tuple[str, str]:
    """(the header's comment lines, the release's file as vendored)."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    head = 0
    while head < len(lines) and lines[head].startswith("#"):
        head += 1
    header = "".join(lines[:head])
    return header, text[len(header):]


def check_release(path: Path, tag: str) -> None:
    """The header names ``tag``, and the body is the git blob the header names."""
    header, body = header_and_body(path)
    assert f"tag        {tag} " in header
    blob = re.search(r"git blob ([0-9a-f]{40})", header).group(1)
    data = body.encode("utf-8")
    assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == blob


def strict_version_schema(path: Path, version: str) -> dict:
    """The ``openAPIV3Schema`` of the CRD's ``version``, made strict."""
    crd = yaml.load(header_and_body(path)[1], Loader=getattr(yaml, "CSafeLoader",
                                                             yaml.SafeLoader))
    [served] = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return strict_schema(served["schema"]["openAPIV3Schema"])
