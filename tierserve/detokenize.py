"""Incremental detokenization with stop strings, for the server's streams and `tierserve generate`.

Stop token ids end a request inside the engine; stop *strings* can only be seen in text, so
the caller feeds each request's new tokens here and finishes the request once `stopped` is
true. `TextStream.push(new_ids)` returns the text that is safe to send now. It decodes only a
short window of recent tokens (so a long generation costs O(n), not O(n^2)), holds back
the last character while it may be an incomplete UTF-8 one (the U+FFFD, up to three, at the
end of the text: until the tokens after them complete a character or show that they are
real replacement characters), and holds back any tail that could be the start of a stop
string. When a stop string appears, the text before it is released, `stopped` turns true
and everything after is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"
# Tokens whose text still ends in U+FFFD stay pending (their last character may be one whose
# bytes are split across tokens: it is held until a token comes after it, the text before it
# is sent). Past this many, the run is sent as it decodes, U+FFFD and all: a bound on the
# decoding (each token decodes the whole run), met only by runs of tokens that all end
# inside a character.
MAX_PENDING_TOKENS = 64
# A UTF-8 character is at most 4 bytes: at most 3 of them wait for the rest.
MAX_UNFINISHED_BYTES = 3
# Tokens decoded before the new ones, for context: tokenizers that mark word starts (Llama-2's
# and Mistral's SentencePiece) drop the space of a window's first word, so that word must be
# an old one. Only tokens that gave text count: a run of tokens that decode to nothing (special
# tokens, EOS under ignore_eos, padding ids) made a window of no bearings, and the next word
# lost its space.
DECODE_CONTEXT_TOKENS = 4


class Detokenizer(Protocol):
    def decode(self, token_ids: Sequence[int]) -> str: ...


class TextStream:
    """`context_token_ids`: the prompt (its last few tokens are read), for the first output
    tokens' context (never part of the text)."""

    def __init__(
        self, tokenizer: Detokenizer, stop: Sequence[str] = (), context_token_ids: Sequence[int] = ()
    ) -> None:
        self._tok = tokenizer
        self._stop = tuple(s for s in stop if s)
        # Decoded before the pending tokens (see DECODE_CONTEXT_TOKENS), and the tokens not yet
        # turned into text.
        self._context: list[int] = []
        self._before = ""  # the context's text
        self._set_context(list(context_token_ids[-(DECODE_CONTEXT_TOKENS + MAX_UNFINISHED_BYTES) :]))
        self._pending: list[int] = []
        self._sent = 0  # characters of the pending tokens' text sent already (before a held one)
        self._held = ""  # decoded, not yet released (may be the start of a stop string)
        self.stopped = False
        self.num_tokens_used = 0  # tokens up to and including the one that completed a stop string

    def push(self, token_ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        out: list[str] = []
        for token in token_ids:
            self._pending.append(token)
            self.num_tokens_used += 1
            out.append(self._release(self._held + self._decode_new()))
            if self.stopped:
                break
        return "".join(out)

    def flush(self) -> str:
        """At the end of generation: the text still held back (cut at a stop string if one completes)."""
        if self.stopped:
            return ""
        tail = ""
        if self._pending:
            before = self._before
            tail = self._tok.decode(self._context + self._pending)[len(before) + self._sent :]
            self._pending, self._sent = [], 0
        text = self._release(self._held + tail)
        if not self.stopped:
            text += self._held
        self._held = ""
        return text

    def _decode_new(self) -> str:
        """The pending tokens' text not sent yet, less a last character that may be incomplete."""
        pending = self._pending
        before = self._before
        after = self._tok.decode(self._context + pending)
        if len(after) < len(before):
            return ""  # the new tokens changed the text before them: wait for more
        if (
            after.endswith(_REPLACEMENT)
            and not after.startswith(before)
            and len(pending) < MAX_PENDING_TOKENS
        ):
            # SentencePiece's byte fallback decodes a run of byte tokens as one piece: a
            # finished character before an unfinished one reads as U+FFFD too, until the run
            # is whole ("Hi中" + the first byte of 文 decodes as "Hi����").
            return ""
        new = after[len(before) :]
        if new.endswith(_REPLACEMENT) and len(pending) < MAX_PENDING_TOKENS:
            # Send what comes before it: the text before a character still arriving is final.
            # (Sending it all after a few tokens sent a real character as U+FFFD, and the
            # token that completed it then gave no new text.) A decoder gives an unfinished
            # character one U+FFFD (byte-level BPE) or one a byte (SentencePiece's byte
            # fallback: Llama-2, Mistral), so up to three may be one character to come.
            waiting = min(MAX_UNFINISHED_BYTES, len(new) - len(new.rstrip(_REPLACEMENT)))
            stable = len(new) - waiting
            out = new[self._sent : stable]
            self._sent = max(self._sent, stable)
            return out
        self._pending = []
        out = new[self._sent :]
        self._sent = 0
        if new:
            self._set_context(self._context + pending)
        return out

    def _set_context(self, ids: list[int]) -> None:
        """The last DECODE_CONTEXT_TOKENS of `ids` as the context, reaching back up to three
        more so as not to begin inside a character: a byte-fallback decoder reads a run of
        byte tokens as one piece, and one that begins with a character's later bytes reads
        as U+FFFD throughout (a 4-byte emoji after 文 came out as ����)."""
        n = DECODE_CONTEXT_TOKENS
        window = ids[-n:]
        text = self._tok.decode(window)
        for extra in range(1, MAX_UNFINISHED_BYTES + 1):
            if len(ids) < n + extra or not text.startswith(_REPLACEMENT):
                break
            window = ids[-(n + extra) :]
            text = self._tok.decode(window)
        self._context, self._before = window, text

    def _release(self, text: str) -> str:
        if not self._stop:
            self._held = ""
            return text
        cut = min((i for i in (text.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return text[:cut]
        keep = _stop_prefix_len(text, self._stop)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]


def _stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
