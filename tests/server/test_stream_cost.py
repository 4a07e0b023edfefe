"""A streamed answer's steps cost what they add, however long the answer: counted here
by the ids and characters each step reads, not timed. The usage of every chunk
(``continuous_usage_stats``) reads each id once; the check that a step's text goes on
from what was sent reads the seam, not the whole text; and what the steps hand out
still adds up to the whole answer."""

from __future__ import annotations

from test_reasoning_split import _Tokenizer

from kvledger.engine.server.answers import added_text
from kvledger.engine.server.reasoning import ReasoningPlan, ReasoningTokens

MARKERS = ["<think>", "</think>"]


TOK = _Tokenizer(MARKERS)


class CountingIds(list):
    """The ids so far, counting those read out by iteration or slicing."""

    read = 0

    def __iter__(self):
        CountingIds.read += len(self)
        return super().__iter__()

    def __getitem__(self, index):
        item = super().__getitem__(index)
        CountingIds.read += len(item) if isinstance(index, slice) else 1
        return item


class CountingText(str):
    """A text so far, counting the characters read out by indexing, slicing, or compared
    by ``startswith``."""

    read = 0

    def __getitem__(self, index):
        item = super().__getitem__(index)
        CountingText.read += len(item)
        return item

    def startswith(self, prefix, *args):
        CountingText.read += len(prefix) if isinstance(prefix, str) else 0
        return super().startswith(prefix, *args)


def _answer(parser: str, text: str):
    """``text`` streamed a token a step into a splitter of ``parser``, with the usage of
    every chunk: the reasoning and content it handed out, and its last usage."""
    plan = ReasoningPlan(ReasoningTokens.of(parser, TOK))
    splitter = plan.splitter()
    ids = TOK.encode(text)
    so_far = CountingIds()
    reasoning = content = ""
    usage = None
    for n, token_id in enumerate(ids, 1):
        so_far.append(token_id)
        r, c = splitter.feed(TOK.decode(ids[:n]), so_far, final=n == len(ids))
        reasoning, content = reasoning + r, content + c
        usage = plan.usage_details([splitter], [so_far])
    return reasoning, content, usage


def test_usage_on_every_chunk_reads_each_id_once():
    """deepseek_r1's reasoning_tokens, on each of 3,000 chunks, read each new id once (the
    split itself reads each a few times: 6 here), where a recount read 3,000 x 3,001 / 2;
    and they count what a count of the whole answer does."""
    text = "<think>" + "why" * 1000 + "</think>" + "blue" * 10
    CountingIds.read = 0
    reasoning, content, usage = _answer("deepseek_r1", text)
    ids = len(TOK.encode(text))
    assert CountingIds.read <= 10 * ids, CountingIds.read
    assert (reasoning, content) == ("why" * 1000, "blue" * 10)
    assert usage == {"reasoning_tokens": 3000}


def test_trailing_spaces_of_a_reasoning_add_up():
    """A long run of spaces that a rule holds back (step3p5's) goes out whole once other
    reasoning follows it, and is cut at the reasoning's end, as a whole answer's split."""
    text = "<think>a" + " " * 500 + "b" + " " * 500 + "</think>done"
    reasoning, content, _ = _answer("step3p5", text)
    whole = ReasoningPlan(ReasoningTokens.of("step3p5", TOK)).splitter()
    whole.feed(text, TOK.encode(text), final=True)
    assert (reasoning, content) == (whole.reasoning, whole.content) == (
        "a" + " " * 500 + "b", "done")


def test_the_seam_check_reads_what_a_step_adds():
    """4,000 steps of one character each: each step's check reads the new character and
    a bounded seam before it (a whole-text comparison read 4,000 x 4,001 / 2)."""
    sent, pieces = "", []
    CountingText.read = 0
    for n in range(1, 4001):
        text = CountingText("ab" * (n // 2) + "a" * (n % 2))
        added = added_text(sent, text)
        assert added is not None and len(added) == 1
        pieces.append(added)
        sent = text
    assert "".join(pieces) == sent
    assert CountingText.read <= 4000 * (2 + 2 * 64), CountingText.read


def test_a_text_that_does_not_go_on_from_what_was_sent_adds_nothing():
    assert added_text("hello wor", "hello world") == "ld"
    assert added_text("", "hi") == "hi" and added_text("same", "same") == ""
    assert added_text("hello world", "hello") is None  # shorter: taken back
    assert added_text("hello", "jello there") is None  # changed at the seam


def test_a_splitters_texts_are_joined_when_read_not_each_step():
    """4,000 steps of reasoning and content: the splitter keeps their pieces and joins
    them once, when read (a string attribute's ``+=`` copied the whole text each step);
    what it reads back is the whole answer's split."""
    text = "<think>" + "why" * 2000 + "</think>" + "blue" * 1000
    splitter = ReasoningPlan(ReasoningTokens.of("deepseek_r1", TOK)).splitter()
    ids = TOK.encode(text)
    for n in range(1, len(ids) + 1):
        splitter.feed(TOK.decode(ids[:n]), ids[:n], final=n == len(ids))
    assert len(splitter._reasoning._pieces) > 1000 and len(splitter._content._pieces) > 1000
    assert (splitter.reasoning, splitter.content) == ("why" * 2000, "blue" * 1000)
    assert len(splitter._reasoning._pieces) == len(splitter._content._pieces) == 1
