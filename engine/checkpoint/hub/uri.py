"""A hub model's name: ``hf://ORG/NAME[@REVISION]``, its grammar and its parts. Nothing
here talks to the hub."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from kvledger.engine.errors import BadInput, plain

SCHEME = "hf://"
DEFAULT_REVISION = "main"

_NAME = r"[A-Za-z0-9_.-]{1,96}"
# The uri grammar; the CRD's pattern is built from it (operator/api/crd_schema.py). parse_uri
# checks what a regex without look-ahead cannot: no leading or trailing '.'/'-', no '..'
# or '--' in a name, a revision's shape; on a cluster those come back as InvalidSpec.
HUB_URI_RE = re.compile(rf"hf://(?P<repo>{_NAME}/{_NAME})(?:@(?P<rev>[^@]*))?")
_REVISION = re.compile(r"[A-Za-z0-9_.\-/]{1,255}")
_COMMIT = re.compile(r"[0-9a-f]{40}")


# A bare hub id as `vllm serve ORG/NAME` takes it (the revision after '@' is kvledger's).
BARE_ID_RE = re.compile(rf"{_NAME}/{_NAME}(?:@[^@]*)?")


def model_reference(text: str) -> str:
    """A launch line's model as vLLM resolves it: an existing local path as it is, a bare
    hub id ``ORG/NAME[@REVISION]`` as ``hf://ORG/NAME[@REVISION]`` (the same path as an
    ``hf://`` model from there on), anything else as it is (a missing folder is refused
    later, by name)."""
    if not isinstance(text, str) or is_hub_uri(text) or os.path.exists(text):
        return text
    if BARE_ID_RE.fullmatch(text) and not text.startswith((".", "~")):
        return SCHEME + text
    return text


def with_revision(model: str, revision: str) -> str:
    """``model`` (as ``model_reference`` gives it) at vLLM's ``--revision REVISION``: an
    hf:// model without a revision takes it, one with the same one is as it is; BadInput,
    one line, for one with another, or for a local folder, which has no revisions."""
    if not is_hub_uri(model):
        raise BadInput(f"--revision {plain(revision)}: the model {plain(model)} is a local "
                       "folder, which has no revisions: drop --revision, or name a hub "
                       "model (ORG/NAME or hf://ORG/NAME)")
    named = HUB_URI_RE.fullmatch(model)
    own = named["rev"] if named is not None else None
    if own is None:
        return f"{model}@{revision}"
    if own != revision:
        raise BadInput(f"--revision {plain(revision)} and the model's own revision "
                       f"({plain(model)}) differ: give one")
    return model


def is_hub_uri(text: str) -> bool:
    """Whether ``--model`` names a hub model (``hf://...``) rather than a directory."""
    return isinstance(text, str) and text.startswith(SCHEME)


def is_commit(revision: str) -> bool:
    """Whether a revision is a commit (40 hex digits), which no branch can move."""
    return _COMMIT.fullmatch(revision) is not None


@dataclass(frozen=True)
class HubModel:
    """A model repo on the hub at a revision (a branch, a tag or a commit)."""

    repo_id: str
    revision: str = DEFAULT_REVISION
    uri: str = field(init=False)  # hf://ORG/NAME, with @REVISION unless it is main

    def __post_init__(self) -> None:
        suffix = "" if self.revision == DEFAULT_REVISION else f"@{self.revision}"
        object.__setattr__(self, "uri", f"{SCHEME}{self.repo_id}{suffix}")


def parse_uri(text: str) -> HubModel:
    """``hf://ORG/NAME[@REVISION]`` -> HubModel; BadInput with one line when malformed."""
    match = HUB_URI_RE.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise BadInput(f"bad hub model {text!r}: expected hf://ORG/NAME[@REVISION] (letters, "
                       "digits, '-', '_' and '.'; at most 96 characters each)")
    repo, revision = match["repo"], match["rev"]
    for part in repo.split("/"):
        if part[0] in ".-" or part[-1] in ".-" or ".." in part or "--" in part:
            raise BadInput(f"bad hub model {text!r}: {part!r} may not start or end with '.' "
                           "or '-', nor hold '..' or '--'")
    if revision is None:
        revision = DEFAULT_REVISION
    elif (not _REVISION.fullmatch(revision) or ".." in revision or revision[0] in "/-"
          or revision.endswith("/")):
        raise BadInput(f"bad hub model {text!r}: the revision after '@' must be a branch, tag "
                       "or commit (letters, digits, '-', '_', '.', '/')")
    return HubModel(repo, revision)
