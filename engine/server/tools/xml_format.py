"""qwen3_coder (and its other name, qwen3_xml): Qwen3-Coder's and Qwen3.5's calls, read
as the text grows (``CallScanner`` drives)::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Read as vLLM 0.32's engine reads them (``vllm/parser/qwen3.py``'s transitions, no
reasoning parser beside it): ``<tool_call>`` or a bare ``<function=`` opens a call, its
name runs to the first ``>`` (one that closes another tag, ``<tool_call>`` say, is part
of the name) or ``</function>``, its arguments to ``</function>`` (``xml_arguments``),
and ``</tool_call>`` goes back to content; text between those tags that is none of them
(``<tool_call>``'s newline, anything else) is dropped. A call whose name is blank is no
call. The text before, between and after calls is content, as vLLM's stream sends it
(its whole answer drops what follows a call). A call cut off by the end of the text ends
there: named with what was read of its name, with the parameters written so far.

seed_oss (Seed-OSS) writes the same calls in ``<seed:tool_call>``/``</seed:tool_call>``,
and vLLM's ``SeedOssParser`` is ``Qwen3Parser`` with those wrapper tags (and
``<seed:think>``): one reader, given each format's ``XmlTags``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvledger.engine.server.tools.call_pieces import (
    Arguments,
    OpenCall,
    Piece,
    ToolCall,
    content_until,
    held,
)
from kvledger.engine.server.tools.xml_arguments import XmlArguments

FUNCTION, FUNCTION_END = "<function=", "</function>"


@dataclass(frozen=True)
class XmlTags:
    """A format's wrapper tags around ``<function=...>`` (and its reasoning tags, which
    vLLM's lexer also reads: a '>' that ends one is no end of a name)."""

    tool_start: str
    tool_end: str
    think_start: str
    think_end: str

    def ending_in_gt(self) -> tuple[str, ...]:
        return (self.tool_start, self.tool_end, FUNCTION_END, "</parameter>",
                self.think_start, self.think_end)

    def after(self, mode: str) -> tuple[str, ...]:
        """The tags that end the text dropped inside a call's wrapper."""
        if mode == "preamble":
            return (self.tool_end, FUNCTION)
        return (self.tool_end, self.tool_start, FUNCTION)


QWEN3 = XmlTags("<tool_call>", "</tool_call>", "<think>", "</think>")
SEED = XmlTags("<seed:tool_call>", "</seed:tool_call>", "<seed:think>", "</seed:think>")
TOOL_START, TOOL_END = QWEN3.tool_start, QWEN3.tool_end


def qwen3_coder(scanner, text: str, final: bool) -> list[Piece]:
    return _read(QWEN3, scanner, text, final)


def seed_oss(scanner, text: str, final: bool) -> list[Piece]:
    return _read(SEED, scanner, text, final)


def _read(tags: XmlTags, scanner, text: str, final: bool) -> list[Piece]:
    out: list[Piece] = []
    while True:
        mode = scanner.mode
        if mode in ("start", "content"):
            found = content_until(scanner, text, (tags.tool_start, FUNCTION), final, out)
            if found is None:
                return out
            _open(tags, scanner, *found)
        elif mode in ("preamble", "between"):  # inside the wrapper, outside a function
            if not _skip_to_tag(tags, scanner, text, tags.after(mode), final):
                return out
        elif mode == "name":
            if not _name(tags, scanner, text, final, out):
                return out
        elif not _arguments(scanner, text, final, out):
            return out


def _open(tags: XmlTags, scanner, at: int, tag: str) -> None:
    """``tag`` read at ``at``: into a call (its name next) or ``<tool_call>``'s inside."""
    scanner.pos = at + len(tag)
    if tag == FUNCTION:
        scanner.mode, scanner.open = "name", OpenCall(scanner.pos, at)
    elif tag == tags.tool_start:
        scanner.mode = "preamble"
    else:
        scanner.mode = "content"


def _skip_to_tag(tags: XmlTags, scanner, text: str, ends: tuple[str, ...],
                 final: bool) -> bool:
    """Past the text before the first of ``ends`` (True once one is read)."""
    pos = scanner.pos
    found = min(((at, t) for t in ends if (at := scanner.find(text, t, pos)) >= 0),
                default=None)
    if found is not None:
        _open(tags, scanner, *found)
        return True
    if final:
        scanner.pos, scanner.mode = len(text), "content"
    else:
        scanner.pos = len(text) - max(held(text, pos, t) for t in ends)
    return False


def _name(tags: XmlTags, scanner, text: str, final: bool, out: list[Piece]) -> bool:
    """The call's name: True once read (the call given out if it is not blank)."""
    open_ = scanner.open
    end, args_at = _name_end(tags.ending_in_gt(), text, scanner.pos, open_.at)
    if end is None and not final:
        scanner.pos = max(scanner.pos, len(text) - len(FUNCTION_END))  # a tag may be waiting
        return False
    name = text[open_.at:len(text) if end is None else end].strip()
    if name:
        open_.call = ToolCall(name, id=scanner.new_id())
        out.append(open_.call)
    open_.state = XmlArguments(scanner.properties(name))
    if end is None or args_at is None:  # </function>, or the end of the text: no arguments
        open_.span = None
        _end_call(scanner, open_, "", 0, 0, True, out)
        scanner.pos = len(text) if end is None else end + len(FUNCTION_END)
        scanner.mode = "between" if end is not None else "content"
        return end is not None
    scanner.pos, scanner.mode = args_at, "arguments"
    open_.at = args_at
    return True


def _name_end(ending_in_gt: tuple[str, ...], text: str, pos: int, start: int
              ) -> tuple[int | None, int | None]:
    """Where the name that begins at ``start`` ends (its '>'s before ``pos`` are all
    other tags'), and where its arguments begin (None: it ends with ``</function>``);
    (None, None) while no end is in ``text``."""
    j = text.find(">", pos)
    while j >= 0:
        tag = next((t for t in ending_in_gt if text.startswith(t, j + 1 - len(t))
                    and j + 1 - len(t) >= start), None)
        if tag == FUNCTION_END:
            return j + 1 - len(tag), None
        if tag is None:
            return j, j + 1
        j = text.find(">", j + 1)
    return None, None


def _arguments(scanner, text: str, final: bool, out: list[Piece]) -> bool:
    """The call's arguments, up to ``</function>``: True once over."""
    open_ = scanner.open
    end = text.find(FUNCTION_END, max(open_.at, scanner.pos - len(FUNCTION_END)))
    over = end >= 0 or final
    raw_end = end if end >= 0 else len(text) if final else \
        len(text) - held(text, open_.at, FUNCTION_END)
    _end_call(scanner, open_, text, open_.at, raw_end, over, out)
    if not over:
        scanner.pos = raw_end
        return False
    scanner.pos = len(text) if end < 0 else end + len(FUNCTION_END)
    scanner.mode = "between" if end >= 0 else "content"
    return end >= 0


def _end_call(scanner, open_: OpenCall, text: str, start: int, stop: int, over: bool,
              out: list[Piece]) -> None:
    more = open_.state.advance(text, start, stop, over)
    if more and open_.call is not None:
        out.append(Arguments(open_.call, more))
    if over:
        scanner.open = None
