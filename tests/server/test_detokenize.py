from __future__ import annotations

from tests.server.helpers import ByteTokenizer
from tierserve.server.detokenize import TextStream


def _feed(stream: TextStream, text: str, per_push: int = 1) -> list[str]:
    data = list(text.encode())
    return [stream.push(data[i : i + per_push]) for i in range(0, len(data), per_push)]


def test_text_comes_out_as_tokens_arrive() -> None:
    stream = TextStream(ByteTokenizer())
    assert _feed(stream, "abc") == ["a", "b", "c"]
    assert stream.flush() == ""


def test_multibyte_characters_are_held_until_complete() -> None:
    stream = TextStream(ByteTokenizer())
    out = _feed(stream, "é€")
    assert out == ["", "é", "", "", "€"]


def test_bytes_that_never_make_a_character_are_sent_once_no_character_could_still_form() -> None:
    """A demo model's random bytes: held while they could still be the start of a UTF-8
    character (at most 4 bytes), then sent as replacement characters, not at the end."""
    stream = TextStream(ByteTokenizer())
    out = [stream.push([0xFF]) for _ in range(10)]
    assert out[:3] == ["", "", ""] and "\ufffd" in out[3]
    assert "".join(out).count("\ufffd") >= 4  # the first four, then the rest as they come
    assert "".join(out) + stream.flush() == bytes([0xFF] * 10).decode(errors="replace")


def test_stop_string_across_tokens_is_cut_and_never_sent() -> None:
    stream = TextStream(ByteTokenizer(), stop=["STOP"])
    out = _feed(stream, "go STOP more")
    assert "".join(out) == "go "
    assert stream.stopped and stream.num_tokens_used == len("go STOP")
    assert all("S" not in piece for piece in out)
    assert stream.push([65]) == "" and stream.flush() == ""


def test_a_false_start_of_a_stop_string_is_released_later() -> None:
    stream = TextStream(ByteTokenizer(), stop=["</end>"])
    out = _feed(stream, "a </en b")
    assert out[:6] == ["a", " ", "", "", "", ""]
    assert "".join(out) + stream.flush() == "a </en b"
    assert not stream.stopped


def test_earliest_of_several_stop_strings_wins() -> None:
    stream = TextStream(ByteTokenizer(), stop=["world", "lo"])
    assert "".join(_feed(stream, "hello world", per_push=11)) == "hel"


def test_held_text_is_released_at_the_end() -> None:
    stream = TextStream(ByteTokenizer(), stop=["xyz"])
    assert "".join(_feed(stream, "abcxy")) == "abc"
    assert stream.flush() == "xy"
