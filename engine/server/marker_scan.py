"""Where a marker's tokens wrote its text in an answer, when ordinary tokens may spell the
same text and the text lags the ids (``reasoning.ReasoningSplitter`` reads its markers
with it): one ``MarkerScan`` per marker and answer, read on as the answer grows, so the
markers of a streamed answer cost its length once."""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class MarkerScan:
    """How far one marker's tokens have been found in an answer's text (which only grows,
    as its ids do): the ids read (``next_id``), the ordinary ones since the last marker,
    where the search goes on, and each marker's id index and place in the text (a
    splitter's scans serve its one answer)."""

    marker_id: int
    next_id: int = 0
    ordinary: list[int] = field(default_factory=list)
    text_at: int = 0
    ids: list[int] = field(default_factory=list)
    places: list[int] = field(default_factory=list)

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
            spelled = decode(self.ordinary).count(marker) \
                if self.ordinary and decode is not None else 0
            start = self.text_at
            for _ in range(spelled + 1):
                at = text.find(marker, start)
                if at < 0:
                    return False
                start = at + len(marker)
            self.ids.append(self.next_id)
            self.places.append(start - len(marker))
            self.ordinary, self.text_at = [], start
            self.next_id += 1
        return True

    def between(self, first: int, end: int) -> list[int]:
        """The places of the markers read among ``ids[first:end]``."""
        return self.places[bisect.bisect_left(self.ids, first):
                           bisect.bisect_left(self.ids, end)]


def without(text: str, places: list[int], width: int) -> str:
    """``text`` less the ``width`` characters at each of ``places``."""
    kept, start = [], 0
    for at in places:
        kept.append(text[start:at])
        start = at + width
    return "".join(kept) + text[start:]
