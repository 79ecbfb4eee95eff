"""StopStringChecker: incremental text, held-back tails, stop strings across token boundaries."""

from __future__ import annotations

from collections.abc import Sequence

from tierserve.executors.pytorch.stop import StopStringChecker
from tierserve.executors.pytorch.tokenizer import ByteTokenizer


class WordTokenizer:
    """Each id is a word; a word-start marker gives the space, dropped at the start of a decode."""

    WORDS = ("▁hello", "▁world", "!", "▁STOP", "▁the", "▁end", "")  # 6: EOS, decodes to nothing

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(self.WORDS[t] for t in token_ids).replace("▁", " ").lstrip(" ")


def stream(checker: StopStringChecker, pieces: Sequence[Sequence[int]]) -> list[str]:
    return [checker.push(p) for p in pieces]


def test_without_stops_text_streams_token_by_token() -> None:
    c = StopStringChecker(WordTokenizer(), context_token_ids=[4])
    assert stream(c, [[0], [1], [2]]) == [" hello", " world", "!"]
    assert c.text == " hello world!" and not c.stopped and c.flush() == ""


def test_a_word_after_a_token_that_decodes_to_nothing_keeps_its_space() -> None:
    """EOS under ignore_eos: a decode window starting at it dropped the next word's space."""
    c = StopStringChecker(WordTokenizer(), context_token_ids=[4])
    assert "".join(stream(c, [[0], [6], [1], [1]])) + c.flush() == " hello world world"


def test_a_word_after_a_run_of_tokens_that_decode_to_nothing_keeps_its_space() -> None:
    """Four of them or more (special tokens, padding ids) filled the whole decode window."""
    for run in (4, 7, 200):
        c = StopStringChecker(WordTokenizer(), context_token_ids=[4])
        pieces = [[0], *([6] for _ in range(run)), [1]]
        assert "".join(stream(c, pieces)) + c.flush() == " hello world", run


def test_stop_string_spanning_tokens_ends_the_text_before_it() -> None:
    tok = ByteTokenizer()
    c = StopStringChecker(tok, stop=["END"])
    out = stream(c, [tok.encode(s, add_special_tokens=False) for s in ["abc E", "N", "Dxyz"]])
    assert out == ["abc ", "", ""]  # "E", then "EN", are held back: they may start "END"
    assert c.stopped and c.matched_stop == "END" and c.text == "abc "
    assert c.push([65]) == "" and c.flush() == ""


def test_held_back_tail_is_released_when_it_does_not_become_a_stop() -> None:
    tok = ByteTokenizer()
    c = StopStringChecker(tok, stop=["END"])
    assert c.push(tok.encode("xE", add_special_tokens=False)) == "x"
    assert c.push(tok.encode("Nx", add_special_tokens=False)) == "ENx"
    c.push(tok.encode("EN", add_special_tokens=False))
    assert c.flush() == "EN" and c.text == "xENxEN" and not c.stopped


def test_earliest_of_several_stops_wins() -> None:
    c = StopStringChecker(WordTokenizer(), stop=["end", "STOP"])
    c.push([0, 3, 4, 5])
    assert c.stopped and c.matched_stop == "STOP" and c.text == "hello "


def test_partial_utf8_character_waits_for_its_last_byte() -> None:
    tok = ByteTokenizer()
    raw = list("é!".encode())  # é is two bytes
    c = StopStringChecker(tok)
    assert c.push(raw[:1]) == ""
    assert c.push(raw[1:]) == "é!"
