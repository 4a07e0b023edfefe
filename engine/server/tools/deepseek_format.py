"""deepseek_v3 (DeepSeek-V3, R1-0528) and deepseek_v31 (DeepSeek-V3.1): calls between DeepSeek's special tokens, read as the text grows
(``CallScanner`` drives)::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>                          (deepseek_v3)

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>
                                                                    (deepseek_v31)

Read as vLLM 0.32 reads a whole answer (``DeepSeekV3ToolParser``,
``DeepSeekV31ToolParser``): without ``<｜tool▁calls▁begin｜>`` the answer is content;
with it, the content is the text before it, and the calls are every match of the call
pattern anywhere in the answer (lines: no match spans a newline except V3's fixed ones),
arguments as written. A V3 call's first field is its type: one that is not ``function``
makes vLLM's whole answer content.

The stream gives out the content before the marker as it is written, then each
deepseek_v31 call whole once its ``<｜tool▁call▁end｜>`` is read (no later text can
change a match already made: each is bounded by its line and end marker). deepseek_v3's
calls go out at the end, since any one's type may still make the answer content.
"""

from __future__ import annotations

from kvledger.engine.server.tools.call_pieces import Piece, content_until, whole_calls

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
MARKERS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)
V3_ARGUMENTS = "\n```json\n"  # between a V3 call's name and its arguments
V3_CLOSE = "\n```"            # after them, before <｜tool▁call▁end｜>

def _content(scanner, text: str, final: bool, out: list[Piece]) -> bool:
    """Content up to ``<｜tool▁calls▁begin｜>``: True once it is read (the calls' turn,
    searched from the answer's start, where vLLM's search begins)."""
    if scanner.mode == "calls":
        return True
    if content_until(scanner, text, (CALLS_BEGIN,), final, out) is None:
        return False
    scanner.mode, scanner.pos = "calls", 0
    return True


def deepseek_v31(scanner, text: str, final: bool) -> list[Piece]:
    out: list[Piece] = []
    if not _content(scanner, text, final, out):
        return out
    while (call := _next_v31(scanner, text, final)) is not None:
        out += whole_calls(scanner, [call])
    return out


def deepseek_v3(scanner, text: str, final: bool) -> list[Piece]:
    out: list[Piece] = []
    if not _content(scanner, text, final, out) or not final:
        return out
    matches = []
    while (match := _next_v3(text, scanner)) is not None:
        matches.append(match)
    if any(kind != "function" for kind, _, _ in matches):  # vLLM's answer is then all content
        return [*out, text[text.index(CALLS_BEGIN):]]
    return out + whole_calls(scanner, [(name, arguments) for _, name, arguments in matches])


# vLLM's patterns, read without a regex's backtracking (which is quadratic on a line of
# many <｜tool▁call▁begin｜>, and a client can steer a model into writing one): '.' stops
# at a newline, so a call lies on one line (V3's arguments on the next), and where the
# call starting at a line's first <｜tool▁call▁begin｜> fails, every later one on that
# line fails too: the search goes on at the next line.

def _next_v31(scanner, text: str, final: bool) -> tuple[str, str] | None:
    """The next ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>`` from
    ``scanner.pos`` (both lazy: up to the first sep, then the first end), moving past it;
    None when there is none yet. Each marker is searched once (``scanner.find``)."""
    while (begin := scanner.find(text, CALL_BEGIN, scanner.pos)) >= 0:
        line_end = scanner.find(text, "\n", begin)
        bound = len(text) if line_end < 0 else line_end
        sep = scanner.find(text, SEP, begin + len(CALL_BEGIN))
        end = -1 if not 0 <= sep < bound else scanner.find(text, CALL_END, sep + len(SEP))
        if end >= 0 and end + len(CALL_END) <= bound:
            scanner.pos = end + len(CALL_END)
            return text[begin + len(CALL_BEGIN):sep], text[sep + len(SEP):end]
        if line_end < 0:  # the line may still end the call (or, at the end, none will)
            if final:
                scanner.pos = len(text)
            return None
        scanner.pos = line_end + 1
    return None


def _next_v3(text: str, scanner) -> tuple[str, str, str] | None:
    """The next V3 call from ``scanner.pos`` as ``(type, name, arguments)`` (greedy: the
    type up to the line's last sep, the name to the line's end, the arguments the next
    line, then V3_CLOSE and the end marker), moving past it; None when there is none."""
    while (begin := text.find(CALL_BEGIN, scanner.pos)) >= 0:
        line_end = text.find("\n", begin)
        if line_end < 0:
            return None
        scanner.pos = line_end + 1
        sep = text.rfind(SEP, begin + len(CALL_BEGIN), line_end)
        if sep < 0 or not text.startswith(V3_ARGUMENTS, line_end):
            continue
        arguments = line_end + len(V3_ARGUMENTS)
        arguments_end = text.find("\n", arguments)
        if arguments_end < 0 or not text.startswith(V3_CLOSE + CALL_END, arguments_end):
            continue
        scanner.pos = arguments_end + len(V3_CLOSE + CALL_END)
        return (text[begin + len(CALL_BEGIN):sep], text[sep + len(SEP):line_end],
                text[arguments:arguments_end])
    return None
