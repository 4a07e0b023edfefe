"""Model sources kvledger does not take, each refused with the kvledger way to say it.

KServe names a model ``storageUri: hf://ORG/NAME:REVISION``, ``pvc://CLAIM/PATH``,
``s3://``, ``gs://`` or ``oci://``; kvledger's ``spec.model`` takes a hub model
(``hf://ORG/NAME[@REVISION]``) or a directory on a volume. The CRD's pattern on
``model.uri`` refuses all of these with a bare regex; each rule here (a CEL expression and
the same check in Python, made ``spec_rules`` entries on ``model``) says what to write
instead, at ``kubectl apply`` beside the pattern's error and in ``kvledger run``. Every
uri a rule refuses, the pattern refuses too: the accepted set is the pattern's.

A KServe-shaped spec (``spec.predictor``) is refused as a whole, naming kvledger's fields.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from kvledger.engine.errors import BadInput

# (RE2 and Python regex on model.uri, the refusal). Each is anchored, so CEL's matches()
# (a search) and re.match() agree.
SOURCES: tuple[tuple[str, str], ...] = (
    (r"^hf://[^@]*:",
     "model.uri: a hub model's revision follows '@': write hf://ORG/NAME@REVISION (KServe's "
     "hf://ORG/NAME:REVISION is not kvledger's)"),
    (r"^https?://(www[.])?huggingface[.]co/",
     "model.uri: a hub model is hf://ORG/NAME[@REVISION], not its web page "
     "(https://huggingface.co/ORG/NAME); a hub mirror goes in model.endpoint"),
    (r"^pvc://",
     "model.uri: pvc:// is KServe's; a checkpoint on a PersistentVolumeClaim is model.path "
     "(its directory, under model.volume.mountPath) with "
     "model.volume.persistentVolumeClaim.claimName"),
    (r"^(s3|gs|oci|hdfs|webhdfs)://",
     "model.uri: s3://, gs://, oci:// and hdfs:// are not supported (kvledger downloads "
     "from the Hugging Face Hub alone): mount the checkpoint as a volume (model.volume, e.g. "
     "a PersistentVolumeClaim a CSI driver fills from the bucket) and give its directory as "
     "model.path"),
)


def cel(pattern: str) -> str:
    """The rule on ``model``: a uri, where given, does not match ``pattern``."""
    return f"!has(self.uri) || !self.uri.matches('{pattern}')"


def holds(pattern: str):
    """``cel(pattern)``'s verdict in Python, on ``model``."""
    return lambda model: not isinstance(model.get("uri"), str) or re.match(
        pattern, model["uri"]) is None


def refusal(uri: Any) -> str | None:
    """The first rule's refusal of ``uri``, or None when no rule names it."""
    for pattern, message in SOURCES:
        if isinstance(uri, str) and re.match(pattern, uri):
            return message
    return None


KSERVE_SHAPE = (
    "spec.predictor is KServe's InferenceService (serving.kserve.io); kvledger's "
    "(kvledger.dev/v1alpha1) has no predictor: predictor.model.storageUri is spec.model.uri "
    "(hf://ORG/NAME[@REVISION]) or spec.model.path (a directory on spec.model.volume), args "
    "are spec.engine's fields (vLLM's flags in camelCase: --max-model-len is "
    "engine.maxModelLen), resources are spec.resources (CPU, memory) and spec.gpus (GPUs); "
    "modelFormat has none (kvledger serves Hugging Face checkpoints with its own engine)")


def check_kserve_shape(spec: Any) -> None:
    """BadInput naming kvledger's fields for a spec written as KServe's."""
    if isinstance(spec, Mapping) and "predictor" in spec:
        raise BadInput(KSERVE_SHAPE)
