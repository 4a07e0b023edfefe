"""The JSON merge patch an apply sends, from kubectl's last-applied record.

A merge patch leaves a key it does not name, so a field dropped from the desired state
must be named with null, and only one we set before may be (another writer's stays);
a child already holding every field we set is left alone (the server adds defaults).
"""

from __future__ import annotations

from typing import Any

from kvledger.engine import json_text

# An object as the API server sends and takes it (JSON); a built-in kind's goes out as
# the client's typed model of it (kube.typed).
Body = dict[str, Any]
# The body last applied to a child, as kubectl's last-applied-configuration: a merge patch
# leaves a key it does not name, so a field dropped from the desired state (a nodeSelector
# taken out of the spec) must be named with null, and only a field we set before may be.
LAST_APPLIED = "kvledger.dev/last-applied"


def last_applied(live: Body) -> Body:
    text = ((live.get("metadata") or {}).get("annotations") or {}).get(LAST_APPLIED)
    try:
        last = json_text.loads(text) if text else {}
    except ValueError:
        return {}
    return last if isinstance(last, dict) else {}


def removals(last: Body, desired: Body, live: object) -> Body:
    """The merge patch (nulls) that removes what ``last`` set, ``desired`` drops and ``live``
    still has; lists need none (a merge patch replaces a list whole)."""
    out: Body = {}
    if not isinstance(live, dict):
        return out
    for key, value in last.items():
        if key not in desired:
            if key not in live:
                continue
            others = (isinstance(value, dict) and isinstance(live[key], dict)
                      and live[key].keys() - value.keys())
            if others:  # a map others write to as well (annotations): only our keys go
                nested = removals(value, {}, live[key])
                if nested:
                    out[key] = nested
            else:
                out[key] = None
        elif isinstance(value, dict) and isinstance(desired[key], dict):
            nested = removals(value, desired[key], live.get(key))
            if nested:
                out[key] = nested
    return out


def merged(desired: Body, removed: Body) -> Body:
    out = dict(desired)
    for key, value in removed.items():
        out[key] = merged(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out


def contains(live: object, desired: object) -> bool:
    """Whether every field we set is already so (the server adds defaults we ignore)."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(
            key in live and contains(live[key], value) for key, value in desired.items())
    if isinstance(desired, list):
        return (isinstance(live, list) and len(live) == len(desired)
                and all(contains(a, b) for a, b in zip(live, desired, strict=True)))
    return live == desired or str(live) == str(desired)
