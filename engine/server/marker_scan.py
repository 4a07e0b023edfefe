"""Where a marker's tokens wrote its text in an answer, when ordinary tokens may spell the
same text and the text lags the ids (``reasoning.ReasoningSplitter`` reads its markers
with it): one ``MarkerScan`` per marker and answer, read on as the answer grows, so the
markers of a streamed answer cost its length once, and a marker whose text is still to
come (held back behind a stop string's possible start, for as many steps as the client's
longest stop string is long) costs each step the text that step adds."""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class MarkerScan:
    """How far one marker's tokens have been found in an answer's text (which only grows,
    as its ids do): the ids read (``next_id``), the ordinary ones since the last marker,
    where the search goes on, and each marker's id index and place in the text (a
    splitter's scans serve its one answer). ``left``: while a marker's text is awaited,
    how many more times its text is still to be found (its own and those the ordinary ids
    before it spell), so that each try goes on from the last one's end."""

    marker_id: int
    next_id: int = 0
    ordinary: list[int] = field(default_factory=list)
    text_at: int = 0
    ids: list[int] = field(default_factory=list)
    places: list[int] = field(default_factory=list)
    left: int | None = None

    def read(self, text: str, ids: list[int], end: int, marker: str,
             decode: Callable[[list[int]], str] | None) -> bool:
        """Read ``ids[:end]`` on from where it stopped; False at a marker whose text is not
        written yet (read again from that marker next time)."""
        while self.next_id < end:
            token_id = ids[self.next_id]
            if token_id != self.marker_id:
                self.ordinary.append(token_id)
                self.next_id += 1
                continue
            if self.left is None:  # decoded once per marker, however long its text waits
                self.left = 1 + (decode(self.ordinary).count(marker)
                                 if self.ordinary and decode is not None else 0)
            while self.left:
                at = text.find(marker, self.text_at)
                if at < 0:  # the text so far ends before it: look on from its last chars
                    self.text_at = max(self.text_at, len(text) - len(marker) + 1)
                    return False
                self.text_at, self.left = at + len(marker), self.left - 1
            self.ids.append(self.next_id)
            self.places.append(self.text_at - len(marker))
            self.ordinary, self.left = [], None
            self.next_id += 1
        return True

    def between(self, first: int, end: int) -> list[int]:
        """The places of the markers read among ``ids[first:end]``."""
        return self.places[bisect.bisect_left(self.ids, first):
                           bisect.bisect_left(self.ids, end)]


@dataclass
class MarkerLook:
    """Where the next of some marker ids is among an answer's ids, from a place: a
    splitter's step that waits for a marker's text looks again from the same place, so
    where the last look stopped is kept, and each step reads only the ids it added."""

    key: tuple[int, tuple[int | None, ...]] | None = None  # the last look's place and ids
    looked: int = 0

    def first(self, ids: list[int], first: int, wanted: tuple[int | None, ...]) -> int | None:
        """The first index of one of ``wanted`` in ``ids`` (which only grow) from
        ``first``, or None."""
        start = self.looked if self.key == (first, wanted) else first
        at = next((k for k in range(start, len(ids)) if ids[k] in wanted), None)
        self.key, self.looked = (first, wanted), len(ids) if at is None else at
        return at


def without(text: str, places: list[int], width: int) -> str:
    """``text`` less the ``width`` characters at each of ``places``."""
    kept, start = [], 0
    for at in places:
        kept.append(text[start:at])
        start = at + width
    return "".join(kept) + text[start:]
