"""vLLM's ``allowed_token_ids``: the only tokens a request may write.

Up to a vocabulary's worth of ids, so each cost is paid once per request, never per
choice nor per step: ``AllowedTokenIds`` checks and sorts them when the request's
``SamplingParams`` are made, and its choices' params (``dataclasses.replace`` of those)
carry the same object, checked already; its ``index`` is built once per device, in the
first step that selects with it, and shared by those choices."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any

from kvledger.engine.errors import BadInput

if TYPE_CHECKING:  # the server's request models import SamplingParams without torch
    import torch


class AllowedTokenIds(tuple[int, ...]):
    """A request's allowed token ids: distinct non-negative integers in increasing order,
    never empty (BadInput otherwise). Equal to the plain tuple of those ids."""

    _indexes: dict[Any, torch.Tensor]  # device -> the ids as a long tensor there

    def __new__(cls, token_ids: Iterable[int]) -> AllowedTokenIds:
        if not isinstance(token_ids, list | tuple) or not token_ids or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in token_ids):
            raise BadInput("allowed_token_ids must be a non-empty list of token ids")
        allowed = super().__new__(cls, sorted(set(token_ids)))
        allowed._indexes = {}
        return allowed

    def __reduce__(self) -> tuple[Any, ...]:
        # A copy or a pickle carries the ids, not the device tensors built from them.
        return (AllowedTokenIds, (tuple(self),))

    def index(self, device: torch.device) -> torch.Tensor:
        """The ids as a long tensor on ``device``, built on the first call there (a
        vocabulary's worth takes ~10-20 ms) and the same tensor on every later one."""
        index = self._indexes.get(device)
        if index is None:
            import torch  # here: see the TYPE_CHECKING import above

            index = self._indexes[device] = torch.tensor(self, dtype=torch.long, device=device)
        return index

    def all_in(self, token_ids: Collection[int]) -> bool:
        """Whether every allowed id is among ``token_ids`` (then none is left to write).
        Costs O(len(token_ids)): more allowed ids than those can never all be in them."""
        return len(self) <= len(token_ids) and set(token_ids).issuperset(self)
