"""The reasoning split on answers a client steers (logit_bias, a prompt, an adapter): the
ids, characters and decoded ids it reads cost the answer's length a bounded number of
times, for every ``--reasoning-parser`` rule, whatever markers the model repeats, whole or
streamed, and streamed behind a stop string's hold-back.

A client's stop string holds back as many of the text's last characters as it is long
(``request_output``), so a marker's id may come many steps before its text. The splitter
waits for that text; it used to read again, each waiting step, from where the last
marker stood: the ids since (to find the next marker), the text since (to place it), and
the ordinary ids since, decoded (to count the marker's text they spell): 81 million ids
read for 9,000 ids of ``<think>xxxxxxxx`` behind a 2,400-character stop string."""

from __future__ import annotations

import pytest
from test_reasoning_split import _Tokenizer

from kvledger.engine.server.reasoning import ReasoningPlan, ReasoningTokens
from kvledger.engine.server.reasoning_rules import RULES

MARKERS = sorted({m for r in RULES.values() for m in (r.start, r.end, r.implicit_end,
                                                      *r.requires, *r.tool_markers) if m})


class _Counting(_Tokenizer):
    """The markers of every rule as single tokens; counts the ids ``decode`` reads."""

    read = 0

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        _Counting.read += len(ids)
        return super().decode(ids, skip_special_tokens)


TOK = _Counting(MARKERS)


class Ids(list):
    """The ids so far, counting those read by iteration, slicing, indexing or search."""

    read = 0

    def __iter__(self):
        Ids.read += len(self)
        return super().__iter__()

    def __getitem__(self, index):
        item = super().__getitem__(index)
        Ids.read += len(item) if isinstance(index, slice) else 1
        return item

    def __contains__(self, item):
        Ids.read += len(self)
        return super().__contains__(item)

    def count(self, item):
        Ids.read += len(self)
        return super().count(item)


class Text(str):
    """A text so far, counting the characters read out by slicing or ``find``."""

    read = 0

    def __getitem__(self, index):
        item = super().__getitem__(index)
        Text.read += len(item)
        return item

    def find(self, sub, start=None, end=None):
        at = super().find(sub, start, end)
        Text.read += (at + len(sub) if at >= 0 else len(self)) - (start or 0)
        return at


def _units(rule) -> list[str]:
    """Markup a model can be steered to repeat: markers alone, split by text, reopening,
    and a marker's text spelled by ordinary tokens beside it."""
    start, end = rule.start or "<think>", rule.end
    units = [start + "x" * 8, end + "x" * 8, end + "x" + start + "y" * 6, start + end,
             start + "ab" + end[:-1] + "c"]
    if rule.implicit_end:
        units.append(rule.implicit_end + start + "x" + end)
    units += [start + marker for marker in rule.tool_markers[:1]]
    return units


def _split(name: str, text: str, spelled: bool, held: int | None):
    """``text`` split by ``name``'s rule: whole (``held`` None), or a token a step with the
    text's last ``held`` characters held back until the last step. ``spelled``: the
    markers written by ordinary tokens, a character each. The reasoning, the content,
    and the ids, characters and decoded ids read per id and character of the answer."""
    plan = ReasoningPlan(ReasoningTokens.of(name, TOK))
    splitter = plan.splitter()
    ids = [ord(c) for c in text] if spelled else TOK.encode(text)
    Ids.read = Text.read = _Counting.read = 0
    reasoning = content = ""
    if held is None:
        splitter.feed(Text(text), Ids(ids), final=True)
        plan.usage_details([splitter], [Ids(ids)])
        reasoning, content = splitter.reasoning, splitter.content
    else:
        so_far, pieces, chars = Ids(), [], 0
        for n, token_id in enumerate(ids, 1):
            so_far.append(token_id)
            pieces.append(_Tokenizer.decode(TOK, [token_id]))  # not counted: the engine's
            chars += len(pieces[-1])
            last = n == len(ids)
            shown = "".join(pieces)
            r, c = splitter.feed(Text(shown if last else shown[:max(0, chars - held)]),
                                 so_far, final=last)
            plan.usage_details([splitter], [so_far])
            reasoning, content = reasoning + r, content + c
    size = len(ids) + len(text)
    return reasoning, content, (Ids.read + Text.read + _Counting.read) / size


@pytest.mark.parametrize(("name", "unit"), [(n, u) for n, r in RULES.items()
                                            for u in _units(r)])
@pytest.mark.parametrize("spelled", [False, True])
def test_repeated_markers_are_read_a_bounded_number_of_times(name, unit, spelled):
    text = unit * 150
    whole = _split(name, text, spelled, None)
    assert whole[2] <= 8, (name, unit, whole[2])
    for held in (0, 600):  # a stop string of 600 characters holds its length back
        streamed = _split(name, text, spelled, held)
        assert streamed[:2] == whole[:2], (name, unit, held)  # it adds up to the whole
        assert streamed[2] <= 16, (name, unit, held, streamed[2])
