"""A text that an answer's steps add to, joined only when read (``TextPieces``)."""

from __future__ import annotations


class TextPieces:
    """A growing text kept as pieces, joined once when read and kept joined. ``+=`` on a
    string held by an object copies the whole text each time (CPython extends in place
    only a local name's string), so a long answer's steps would each cost its length."""

    __slots__ = ("_pieces",)

    def __init__(self) -> None:
        self._pieces: list[str] = []

    def add(self, piece: str) -> None:
        if piece:
            self._pieces.append(piece)

    def text(self) -> str:
        """The whole text so far (joined once per read that follows an ``add``)."""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""
