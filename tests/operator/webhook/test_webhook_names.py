"""The webhook refuses a name that cannot name the resource's Service (``names``) before a
pod is made: an API server older than CEL validation stores it past the CRD."""

from __future__ import annotations

import asyncio
import logging

import kopf
import pytest

from kvledger.operator.api.names import NAME_MESSAGE
from kvledger.operator.render.policy import Policy
from kvledger.operator.webhook.fit import Verdict
from kvledger.operator.webhook.webhook import validate


class _Allows:
    """A verdict that lets everything in: only the name can refuse here."""

    async def verdict(self, *args):
        return Verdict(True)


def _review(meta: dict) -> list[str]:
    memo = kopf.Memo(webhook=_Allows(), policy=Policy(), default_image="kvledger:test")
    body = kopf.Body({"metadata": meta, "spec": {"model": {"path": "/m"}, "gpus": 1}})
    warnings: list[str] = []
    asyncio.run(validate(body=body, old=None, operation="CREATE", memo=memo,
                         warnings=warnings, gpu_nodes={}, logger=logging.getLogger("test")))
    return warnings


@pytest.mark.parametrize(("meta", "said"), [
    ({"name": "llama-3.1-8b"}, f"llama-3.1-8b: invalid spec: 'llama-3.1-8b': {NAME_MESSAGE}"),
    ({"name": "a" * 64}, NAME_MESSAGE),
    ({"generateName": "llama-3.1-"}, "metadata.generateName 'llama-3.1-'"),
])
def test_a_name_the_service_cannot_take_is_refused_at_admission(meta, said):
    with pytest.raises(kopf.AdmissionError) as refused:
        _review(meta)
    assert said in str(refused.value) and refused.value.code == 422


@pytest.mark.parametrize("meta", [{"name": "llama-3-1-8b"}, {"generateName": "llama-"}])
def test_a_name_that_can_name_the_children_is_let_in(meta):
    assert _review(meta) == []
