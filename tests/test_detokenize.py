from __future__ import annotations

from tests.server.helpers import ByteTokenizer
from tierserve.detokenize import TextStream


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
    """A demo model's random bytes: U+FFFD is held only while it could still be part of a
    character (three bytes at most wait for a fourth); none waits for the end."""
    stream = TextStream(ByteTokenizer())
    out = [stream.push([0xFF]) for _ in range(10)]
    assert out == ["", "", "", *["\ufffd"] * 7]
    assert "".join(out) + stream.flush() == bytes([0xFF] * 10).decode(errors="replace")


def test_a_character_whose_bytes_straddle_many_tokens_is_never_sent_as_a_replacement() -> None:
    """Byte-level BPE on CJK text: every token ends inside a character (`æ | Ĺ¥æ | Ĺ¥æ ...`).
    After four such tokens the text was sent with its last, incomplete character as U+FFFD,
    and the token that completed it gave no new text: 日日日�日日日 for 日日日日日日日."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab |= {"Ĺ¥": len(vocab), "Ĺ¥æ": len(vocab) + 1}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("Ĺ", "¥"), ("Ĺ¥", "æ")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()

    class Bpe:
        def decode(self, ids: list[int]) -> str:
            return str(tok.decode(list(ids)))

    ids = tok.encode("日" * 7).ids
    assert len(ids) == 8  # seven characters in eight tokens, each but the last ending inside one
    stream = TextStream(Bpe())
    pieces = [stream.push([i]) for i in ids] + [stream.flush()]
    assert "".join(pieces) == "日" * 7 and "\ufffd" not in "".join(pieces)
    assert pieces[1:8] == ["日"] * 7  # each as soon as it is whole
    bytes_stream = TextStream(ByteTokenizer())  # invalid bytes, then a character: the demo model's
    ids = [0xA5, 0xFF, 0x94, 0xD1, 0x8C, 0x41]
    out = "".join(bytes_stream.push([i]) for i in ids) + bytes_stream.flush()
    assert out == bytes(ids).decode(errors="replace") == "\ufffd\ufffd\ufffd\u044cA"


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


class _WordStartTokenizer:
    """Llama-2 / Mistral style: pieces mark a word's start with "▁", and decoding drops the
    space of the first piece decoded."""

    def __init__(self) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        vocab = {"<unk>": 0, "</s>": 1, "▁the": 2, "▁quick": 3, "▁fox": 4}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tok.decoder = decoders.Metaspace(prepend_scheme="first")
        tok.add_special_tokens(["</s>"])
        self._tok = tok

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (1,)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text).ids)

    def decode(self, token_ids: list[int]) -> str:  # type: ignore[override]
        return str(self._tok.decode(list(token_ids), skip_special_tokens=True))

    def apply_chat_template(self, messages: object) -> list[int]:
        raise NotImplementedError


def test_word_start_tokenizers_keep_the_space_of_the_first_word_and_after_an_eos() -> None:
    """The prompt's last tokens give the first output token its leading space, and a token
    that decodes to nothing (EOS under ignore_eos) does not take the next word's."""
    tok = _WordStartTokenizer()
    stream = TextStream(tok, context_token_ids=tok.encode("the"))  # type: ignore[arg-type]
    out = [stream.push([t]) for t in (3, 4, 1, 2, 3)] + [stream.flush()]
    assert "".join(out) == " quick fox the quick"


def test_a_word_after_a_run_of_tokens_that_decode_to_nothing_keeps_its_space() -> None:
    """Four of them or more (special tokens, padding ids) filled the decode window, and the
    next word was sent without its space."""
    tok = _WordStartTokenizer()
    for run in (4, 9):
        stream = TextStream(tok, context_token_ids=tok.encode("the"))  # type: ignore[arg-type]
        out = [stream.push([t]) for t in (3, *[1] * run, 4)] + [stream.flush()]
        assert "".join(out) == " quick fox", run


class _WordTokenizer:
    """Each id is a word; a word-start marker gives the space, dropped at the start of a decode."""

    WORDS = ("▁hello", "▁world", "!", "▁STOP", "▁the", "▁end", "")  # 6: EOS, decodes to nothing

    def decode(self, token_ids: list[int]) -> str:
        return "".join(self.WORDS[t] for t in token_ids).replace("▁", " ").lstrip(" ")


def test_without_stops_each_word_comes_out_with_its_token() -> None:
    stream = TextStream(_WordTokenizer(), context_token_ids=[4])
    assert [stream.push([t]) for t in (0, 1, 2)] == [" hello", " world", "!"]
    assert not stream.stopped and stream.flush() == ""


def test_a_word_after_one_token_that_decodes_to_nothing_keeps_its_space() -> None:
    """EOS under ignore_eos: a decode window starting at it dropped the next word's space."""
    stream = TextStream(_WordTokenizer(), context_token_ids=[4])
    assert "".join(stream.push([t]) for t in (0, 6, 1, 1)) + stream.flush() == " hello world world"


def test_a_stop_string_inside_one_push_of_several_tokens_ends_the_text_before_it() -> None:
    stream = TextStream(_WordTokenizer(), stop=["end", "STOP"])
    assert stream.push([0, 3, 4, 5]) == "hello "
    assert stream.stopped and stream.num_tokens_used == 2


class _ByteFallback:
    """SentencePiece with byte fallback (Llama-2, Mistral, Gemma): words 1 and 2, and a
    token for each byte (3 + the byte) that the decoder turns back into text."""

    def __init__(self, words: tuple[str, str]) -> None:
        from tokenizers import Tokenizer, decoders, models

        vocab = {"<unk>": 0, words[0]: 1, words[1]: 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
        self._tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
        self._tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(list(ids)))


def test_a_byte_fallback_tokenizer_streams_characters_of_three_and_four_bytes_whole() -> None:
    """Each byte of an unfinished character decodes as its own U+FFFD, and a finished
    character before an unfinished one in the same run of byte tokens reads as U+FFFD too.
    中文 went out as ��."""
    tok = _ByteFallback(("▁Hi", "▁there"))
    text = "中文😀"  # three, three and four bytes
    ids = [1, *(3 + b for b in text.encode()), 2]
    stream = TextStream(tok)
    pieces = [stream.push([i]) for i in ids] + [stream.flush()]
    assert "".join(pieces) == tok.decode(ids) == "Hi中文😀 there"
    assert "\ufffd" not in "".join(pieces)


def test_streamed_text_equals_the_whole_decode_for_random_text_and_bytes() -> None:
    """Text of one- to four-byte characters through SentencePiece's byte fallback, and random
    bytes (valid or not) through the demo's byte tokenizer, one token a push: what streams
    out is the whole decode, character for character."""
    import random

    fallback = _ByteFallback(("▁a", "▁the"))
    rng = random.Random(0)
    alphabet = "aé中文😀Ωж"  # one to four bytes each
    for _ in range(200):
        ids: list[int] = []
        for _ in range(rng.randint(1, 12)):
            if rng.random() < 0.3:
                ids.append(rng.choice((1, 2)))
            else:
                ids.extend(3 + b for b in rng.choice(alphabet).encode())
        # A prompt ending in a whole word gives the context; random bytes come with none.
        for tok, context, case in (
            (fallback, [2], ids),
            (ByteTokenizer(), [], [rng.randrange(256) for _ in range(12)]),
        ):
            stream = TextStream(tok, context_token_ids=context)
            out = "".join(stream.push([i]) for i in case) + stream.flush()
            assert out == tok.decode(context + case)[len(tok.decode(context)) :], case
