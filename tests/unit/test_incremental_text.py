"""Incremental detokenization: stop strings never leak while streaming, and are trimmed."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from common.incremental import IncrementalText, held_back


@pytest.fixture(scope="module")
def tok(smol_path):
    return Tokenizer.from_file(str(smol_path / "tokenizer.json"))


def test_held_back_is_the_longest_suffix_that_starts_a_stop():
    assert held_back("hello wor", ["world"]) == 3
    assert held_back("hello", ["world"]) == 0
    assert held_back("abc", ["c", "bcd"]) == 2
    assert held_back("ab", ["abc", "b"]) == 2


def _stream(tok, text, stops, include=False):
    ids = tok.encode(text).ids
    inc = IncrementalText(tok, stops, True, include)
    pieces = []
    matched = None
    for _i, t in enumerate(ids):
        inc.push([t])
        # the scheduler's decision: the first stop string present in the text so far
        matched = next((s for s in stops if s in inc.text), None)
        pieces.append(inc.take(matched is not None, matched))
        if matched:
            break
    else:
        pieces.append(inc.take(True, None))
    return pieces, matched


@pytest.mark.parametrize("stop", ["answer is", "2018-01", "Paris."])
def test_streamed_text_never_contains_the_stop_string(tok, stop):
    text = "The capital of France is Paris. The answer is: 2018-01-22 12:12:53."
    pieces, matched = _stream(tok, text, [stop, "never appears"])
    assert matched == stop
    streamed = "".join(pieces)
    assert stop not in streamed
    assert streamed == text[: text.index(stop)]
    for i in range(len(pieces)):  # no prefix of the stream ever showed the stop
        assert stop not in "".join(pieces[: i + 1])


def test_include_stop_str_keeps_it(tok):
    text = "one two three four"
    pieces, _ = _stream(tok, text, ["three"], include=True)
    assert "".join(pieces) == "one two three"


def test_multibyte_characters_are_never_split(tok):
    text = "café 日本語 🙂 done"
    ids = tok.encode(text).ids
    inc = IncrementalText(tok, None)
    out = []
    for t in ids:
        inc.push([t])
        piece = inc.take(False, None)
        assert "\ufffd" not in piece
        out.append(piece)
    out.append(inc.take(True, None))
    assert "".join(out) == text
