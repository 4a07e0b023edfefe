"""A tool-call reader's steps cost what they add, however long the call: counted by the
characters each step reads of the text so far, not timed. hermes' arguments that end in
a long run of spaces (held back: it may be the last of them) are not looked back over
each step; qwen3_coder's arguments are read on from where the last step stopped; a JSON
call's head (``{"name": ..., "arguments": ``) is read on from where the last step
stopped, not again from its ``{``."""

from __future__ import annotations

from kvledger.engine.server.tools.parsers import ArgumentsDelta, CallScanner, ToolCall


class CountingText(str):
    """A text so far, counting the characters read out of it by indexing or slicing."""

    read = 0

    def __getitem__(self, index):
        item = super().__getitem__(index)
        CountingText.read += len(item)
        return item


def _streamed(parser: str, text: str, step: int = 1):
    """``text`` fed ``step`` characters a step: the content, the calls' names and their
    arguments as handed out, and the characters read."""
    scanner = CallScanner(parser)
    content, calls = "", []
    CountingText.read = 0
    for end in range(step, len(text) + step, step):
        for piece in scanner.feed(CountingText(text[:end]), final=end >= len(text)):
            if isinstance(piece, ToolCall):
                calls.append([piece.name, ""])
            elif isinstance(piece, ArgumentsDelta):
                calls[piece.index][1] += piece.text
            else:
                content += piece
    return content, calls, CountingText.read


def _whole(parser: str, text: str):
    scanner = CallScanner(parser)
    scanner.feed(text, final=True)
    return scanner.content, [[c.name, c.arguments] for c in scanner.calls]


SPACES = 4000


def test_hermes_arguments_ending_in_spaces_are_not_read_again():
    """4,000 spaces in a call's arguments, a character a step: each read about once (the
    look back over the held spaces read 4,000 x 4,001 / 2), handed out as the whole."""
    text = ('<tool_call>\n{"name": "write", "arguments": {"text": "a' + " " * SPACES
            + 'b"}}\n</tool_call>')
    content, calls, read = _streamed("hermes", text)
    assert (content, calls) == _whole("hermes", text)
    assert calls == [["write", '{"text": "a' + " " * SPACES + 'b"}']]
    assert read <= 4 * len(text), read


def test_content_spaces_add_up():
    """A long run of spaces in content is held back and goes out whole once other
    content follows it; the run at the end is dropped, as a whole answer's."""
    text = "a" + " " * SPACES + "b" + " " * SPACES
    content, calls, _ = _streamed("hermes", text, step=3)
    assert (content, calls) == _whole("hermes", text) == ("a" + " " * SPACES + "b", [])


def test_qwen3_coder_arguments_are_read_once():
    text = ("<tool_call>\n<function=write>\n<parameter=text>\n" + "why " * 1000
            + "\n</parameter>\n</function>\n</tool_call>")
    content, calls, read = _streamed("qwen3_coder", text, step=4)
    assert (content, calls) == _whole("qwen3_coder", text)
    assert read <= 4 * len(text), read


HEADS = {  # a long run of whitespace, then a long name, before the arguments
    "hermes": '<tool_call>\n{' + " " * SPACES + '"name": "' + "w" * SPACES
              + '", "arguments": {"text": "a"}}\n</tool_call>',
    "llama3_json": '{' + "\n" * SPACES + '"name": "' + "w" * SPACES
                   + '", "parameters": {"text": "a"}}',
}


def test_a_call_head_is_read_on_not_again():
    """4,000 spaces and a 4,000-character name before a call's arguments, a character a
    step: each read about once (read again from the ``{`` each step: 8,000 x 8,001)."""
    for parser, text in HEADS.items():
        content, calls, read = _streamed(parser, text)
        assert (content, calls) == _whole(parser, text)
        assert calls == [["w" * SPACES, '{"text": "a"}']], parser
        assert read <= 4 * len(text), (parser, read)
