"""Incremental detokenization with stop strings, for the server's streams and `tierserve generate`.

Stop token ids end a request inside the engine; stop *strings* can only be seen in text, so
the caller feeds each request's new tokens here and finishes the request once `stopped` is
true. `TextStream.push(new_ids)` returns the text that is safe to send now. It decodes only a
short window of recent tokens (so a long generation costs O(n), not O(n^2)), holds back
text that ends in an incomplete UTF-8 character (for up to 4 tokens: then the replacement
characters are real and are sent), and holds back any tail that could be the start of a
stop string. When a stop string appears, the text before it is released,
`stopped` turns true and everything after is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"
# A UTF-8 character spans at most 4 bytes, so at most 4 tokens: text still ending in U+FFFD
# after that many is a real replacement character (bytes that decode to none), and is sent.
MAX_INCOMPLETE_TOKENS = 4
# Tokens decoded before the new ones, for context: tokenizers that mark word starts (Llama-2's
# and Mistral's SentencePiece) drop the space of a window's first word, so that word must be
# an old one. Only tokens that gave text count: a run of tokens that decode to nothing (special
# tokens, EOS under ignore_eos, padding ids) made a window of no bearings, and the next word
# lost its space.
DECODE_CONTEXT_TOKENS = 4


class Detokenizer(Protocol):
    def decode(self, token_ids: Sequence[int]) -> str: ...


class TextStream:
    """`context_token_ids`: the prompt's last tokens, for the first output tokens' context
    (never part of the text)."""

    def __init__(
        self, tokenizer: Detokenizer, stop: Sequence[str] = (), context_token_ids: Sequence[int] = ()
    ) -> None:
        self._tok = tokenizer
        self._stop = tuple(s for s in stop if s)
        # Decoded before the pending tokens (see DECODE_CONTEXT_TOKENS), and the tokens not yet
        # turned into text.
        self._context: list[int] = list(context_token_ids[-DECODE_CONTEXT_TOKENS:])
        self._pending: list[int] = []
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
            before = self._tok.decode(self._context)
            tail = self._tok.decode(self._context + self._pending)[len(before) :]
            self._pending = []
        text = self._release(self._held + tail)
        if not self.stopped:
            text += self._held
        self._held = ""
        return text

    def _decode_new(self) -> str:
        pending = self._pending
        before = self._tok.decode(self._context)
        after = self._tok.decode(self._context + pending)
        if len(after) < len(before):
            return ""  # the new tokens changed the text before them: wait for more
        if after.endswith(_REPLACEMENT) and len(pending) < MAX_INCOMPLETE_TOKENS:
            return ""  # an incomplete character: wait for the next token
        self._pending = []
        new = after[len(before) :]
        if new:
            self._context = (self._context + pending)[-DECODE_CONTEXT_TOKENS:]
        return new

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
