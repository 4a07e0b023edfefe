"""``SoFar``: a read-only view of the first ``length`` items of a list that only grows
(a sequence's output ids, its logprobs), handed out by a running request's step output
instead of a copy, so that a step costs what it adds, not the length of the output so
far (a 16k-token answer's copies were 16k items a step).

A view reads as the list it stands for: ``len``, indexing, slicing (a new list of just
that slice), iteration, ``in``, ``==`` against a list, ``+``; ``json`` wants a real list,
so ``list(view)`` (once, at the end) where one is written out. It pickles and copies as
the plain list it shows. The list it views may grow past ``length`` (the engine appends
while the server still reads an older step's output): the view never shows more.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar, overload

T = TypeVar("T")


class SoFar(Sequence[T]):
    """``items[:length]`` without the copy. ``items`` must only ever be appended to."""

    __slots__ = ("_items", "_length")

    def __init__(self, items: list[T], length: int | None = None) -> None:
        self._items = items
        self._length = len(items) if length is None else length

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> T: ...

    @overload
    def __getitem__(self, index: slice) -> list[T]: ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(self._length)
            if step != 1:  # rare (a reversed read): the plain way
                return self._items[:self._length][index]
            return self._items[start:stop]
        if index < 0:
            index += self._length
        if not 0 <= index < self._length:
            raise IndexError("SoFar index out of range")
        return self._items[index]

    def __iter__(self) -> Iterator[T]:
        return itertools.islice(self._items, self._length)

    def __reversed__(self) -> Iterator[T]:
        return reversed(self._items[:self._length])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SoFar | list | tuple):
            return len(other) == self._length and all(
                a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # as a list's: it is not a value that stays put

    def __add__(self, other: Sequence[T]) -> list[T]:
        return self._items[:self._length] + list(other)

    def __radd__(self, other: Sequence[T]) -> list[T]:
        return list(other) + self._items[:self._length]

    def __repr__(self) -> str:
        return repr(self._items[:self._length])

    def __reduce__(self) -> tuple[Any, ...]:
        return list, (self._items[:self._length],)

    def __copy__(self) -> list[T]:
        return self._items[:self._length]

    def __deepcopy__(self, memo: dict) -> list[T]:
        import copy

        return copy.deepcopy(self._items[:self._length], memo)
