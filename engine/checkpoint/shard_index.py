"""``model.safetensors.index.json``: which shard holds each tensor, read as the planner, the
pre-flight and the hub reads need it, member by member (``json_stream``), so an index of
millions of entries costs its entries' count against a ``ReadBudget``, not what
``json.loads`` would build of it first."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvledger.engine.checkpoint.read_limits import ReadBudget
from kvledger.engine.errors import BadInput
from kvledger.engine.json_stream import MalformedJson, NotAnObject, ObjectReader

# How often (entries) the count is checked against the budget while the map is read.
COUNT_EVERY = 1024


@dataclass(frozen=True)
class ShardIndex:
    shards: tuple[str, ...]  # each shard once, in the order the map first names it
    owners: dict[str, str] | None  # tensor name -> shard, when asked for


def read_shard_index(read: Callable[[int], bytes], where: str, budget: ReadBudget, *,
                     owners: bool) -> ShardIndex:
    """The index in ``read`` (``read(n)``: at most n bytes, b"" at the end), named ``where``
    in messages: its shards, and with ``owners`` its map. BadInput when it has no non-empty
    ``weight_map`` of tensor name -> shard file; OverLimit past the budget's tensors."""
    shards: dict[str, str] = {}  # each shard's name, one string for all its entries
    mapped: dict[str, str] = {}
    count = 0
    reader = ObjectReader(read)
    try:
        whole = reader.whole_object()
        if whole is not None:  # it fits in one window: parsed at once
            return _whole_index(whole, where, budget, owners)
        reader.begin()
        while (key := reader.key()) is not None:
            if key != "weight_map":
                reader.value()  # "metadata": total_size, and whatever else a tool wrote
                continue
            if reader.peek() != "{":
                raise BadInput(_needs(where))
            reader.begin()
            while (name := reader.key()) is not None:
                shard = reader.value()
                if not isinstance(shard, str):
                    raise BadInput(_needs(where))
                shard = shards.setdefault(shard, shard)
                if owners:
                    mapped[name] = shard
                count += 1
                if count % COUNT_EVERY == 0:
                    budget.check_index(count)
        reader.end()
    except NotAnObject:
        raise BadInput(_needs(where)) from None
    except MalformedJson as exc:
        raise BadInput(f"{where} is not valid JSON: {exc}") from None
    budget.check_index(count)
    if not shards:
        raise BadInput(_needs(where))
    return ShardIndex(tuple(shards), mapped if owners else None)


def _whole_index(index: dict, where: str, budget: ReadBudget, owners: bool) -> ShardIndex:
    weight_map = index.get("weight_map")
    if (not isinstance(weight_map, dict) or not weight_map
            or not all(isinstance(v, str) for v in weight_map.values())):
        raise BadInput(_needs(where))
    budget.check_index(len(weight_map))
    return ShardIndex(tuple(dict.fromkeys(weight_map.values())), weight_map if owners else None)


def _needs(where: str) -> str:
    return f"{where}: needs a non-empty \"weight_map\" of tensor name -> shard file"
