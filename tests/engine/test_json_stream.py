"""engine/json_stream.py: an object read member by member gives what json.loads gives,
however its bytes arrive (a piece at a time, a character split across pieces), and refuses
a member larger than its window by saying so, not by building it."""

from __future__ import annotations

import io
import json
import random

import pytest

from kvledger.engine import json_stream
from kvledger.engine.json_stream import MalformedJson, NotAnObject, ObjectReader


def read_all(text: bytes, piece: int | None = None) -> dict:
    """The object ``text`` holds, read member by member; nested objects member by member
    too; ``piece`` bytes at most per read."""
    stream = io.BytesIO(text)
    reader = ObjectReader(stream.read if piece is None else lambda n: stream.read(min(n, piece)))

    def obj() -> dict:
        out = {}
        while (key := reader.key()) is not None:
            if reader.peek() == "{":
                reader.begin()
                out[key] = obj()
            else:
                out[key] = reader.value()
        return out

    reader.begin()
    got = obj()
    reader.end()
    return got


def test_members_read_in_pieces_are_json_loads_own():
    rng = random.Random(0)
    for _ in range(40):
        doc = {f"k{i} é✓": rng.choice([
            {"dtype": "BF16", "shape": [rng.randrange(9) for _ in range(3)], "data_offsets": [1, 2]},
            'text with "quotes", \\ 日本語 and 🚀', 12.5e3, None, True, [],
            {"nested": {"deeper": [1, {"x": "y"}]}}]) for i in range(rng.randrange(1, 30))}
        raw = json.dumps(doc, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 2]))
        for piece in (1, 2, 3, 7, None):
            assert read_all(raw.encode(), piece) == json.loads(raw)


@pytest.mark.parametrize(("text", "error"), [
    (b"[1, 2]", NotAnObject), (b'"a"', NotAnObject), (b"xxxx", MalformedJson),
    (b'{"a": 1', MalformedJson), (b'{"a": 1,}', MalformedJson), (b'{"a" 1}', MalformedJson),
    (b'{"a": 1} {}', MalformedJson), (b'{"a": "\\xff"}', MalformedJson),
    (b'{"a": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", MalformedJson),
])
def test_what_is_not_an_object_is_one_error(text, error):
    with pytest.raises(error):
        read_all(text, 5)


def test_a_member_larger_than_the_window_is_refused_as_such(monkeypatch):
    monkeypatch.setattr(json_stream, "MEMBER_MAX_CHARS", 1000)
    small = json.dumps({"a": "x" * 900, "b": [0] * 300}).encode()
    assert read_all(small, 64)["a"] == "x" * 900
    # A nested object read member by member (as an index's weight_map is) may be larger.
    assert len(read_all(json.dumps({"a": {str(i): i for i in range(900)}}).encode(), 64)["a"]) == 900
    for big in ({"a": "x" * 5000}, {"a": [[]] * 2000}, {"k" * 3000: 1}, {"a": 10**3000}):
        with pytest.raises(MalformedJson, match="a member is over"):
            read_all(json.dumps(big).encode(), 64)
