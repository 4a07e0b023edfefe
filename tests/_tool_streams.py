"""A tool-call stream put together as the OpenAI SDK puts it together, for tests that feed
``CallScanner`` text and compare what a stream sends with the whole answer."""

from __future__ import annotations

from kvledger.engine.server.tools.parsers import ToolCall


def assembled(pieces) -> tuple[str, list[tuple[str, str]], list[str]]:
    """``pieces`` (content text; a ``ToolCall`` naming a call; then its arguments'
    fragments, by index) as the content, each call's (name, arguments), and the argument
    fragments in the order they came."""
    content, calls, fragments = "", [], []
    for piece in pieces:
        if isinstance(piece, str):
            content += piece
        elif isinstance(piece, ToolCall):
            calls.append([piece.name, ""])
        else:
            calls[piece.index][1] += piece.text
            fragments.append(piece.text)
    return content, [tuple(call) for call in calls], fragments


def split_once_everywhere(new_scanner, text: str):
    """For each place ``text`` can be cut in two, a fresh scanner (``new_scanner()``) fed
    the part before the cut, then the whole text: ``(cut, content, calls)`` as
    ``assembled`` puts them together."""
    for cut in range(1, len(text)):
        scanner = new_scanner()
        content, calls, _ = assembled(scanner.feed(text[:cut], False) + scanner.feed(text, True))
        yield cut, content, calls
