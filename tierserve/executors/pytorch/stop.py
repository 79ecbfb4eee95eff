"""Incremental detokenization with stop strings, shared by `generate` and the server.

Stop token ids end a request inside the engine; stop *strings* can only be seen in text,
so the caller feeds each request's new tokens here and calls `engine.finish(request_id)`
once `stopped` is true. Text is released only when it is final: an incomplete UTF-8
character, or a tail that could still grow into a stop string, is held back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"  # what a decoder yields for a partial multi-byte character
DECODE_CONTEXT_TOKENS = 4  # text-giving tokens decoded before the new ones, for their leading space


class Detokenizer(Protocol):
    def decode(self, token_ids: Sequence[int]) -> str: ...


class StopStringChecker:
    """Turns a request's output tokens into text, ending it at the first stop string.

    `context_token_ids` (e.g. the last few prompt tokens) only give the decoder its
    bearings — tokenizers that mark word starts drop a leading space otherwise; they are
    never part of the text. The stop string itself is not part of `text`.
    """

    def __init__(
        self, tokenizer: Detokenizer, stop: Sequence[str] = (), context_token_ids: Sequence[int] = ()
    ):
        self._tok = tokenizer
        self._stops = tuple(s for s in stop if s)
        self._max_stop = max((len(s) for s in self._stops), default=0)
        # Decoded before the pending tokens, for their bearings: the last few tokens that gave
        # text (tokens that decode to nothing, special or padding, give a decoder none: a
        # window of them dropped the next word's leading space).
        self._context: list[int] = list(context_token_ids)
        self._pending: list[int] = []  # tokens not yet in `_text`
        self._text = ""
        self._emitted = 0  # characters of `_text` released by push/flush
        self._searched = 0  # stop strings cannot start before this index of `_text`
        self.stopped = False
        self.matched_stop: str | None = None

    @property
    def text(self) -> str:
        """All text decoded so far, cut before the stop string if one matched."""
        return self._text

    def push(self, new_token_ids: Sequence[int]) -> str:
        """Add tokens; return the text that is now final. Ignores tokens once stopped."""
        if self.stopped:
            return ""
        self._pending.extend(new_token_ids)
        if not self._decode_pending(final=False):
            return ""  # mid-character: wait for the next token
        end = len(self._text) if self.stopped else len(self._text) - self._held_back()
        return self._release(end)

    def flush(self) -> str:
        """The request ended: release whatever was held back."""
        if not self.stopped:
            self._decode_pending(final=True)
        return self._release(len(self._text))

    def _decode_pending(self, *, final: bool) -> bool:
        """Move the pending tokens into `_text`; False if they are not final yet."""
        pending = self._pending
        if not pending:
            return True
        prefix = self._tok.decode(self._context)
        full = self._tok.decode(self._context + pending)
        if not final and (full.endswith(_REPLACEMENT) or not full.startswith(prefix)):
            return False
        new = full[_common_prefix_len(prefix, full) :]
        self._text += new
        self._pending = []
        if new:  # the next decode starts a few text-giving tokens back
            self._context = (self._context + pending)[-DECODE_CONTEXT_TOKENS:]
        self._find_stop()
        return True

    def _find_stop(self) -> None:
        if not self._stops:
            return
        start = max(0, self._searched - self._max_stop + 1)
        hits = [(i, s) for s in self._stops if (i := self._text.find(s, start)) >= 0]
        self._searched = len(self._text)
        if hits:
            index, stop = min(hits)
            self._text = self._text[:index]
            self.stopped = True
            self.matched_stop = stop

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        for k in range(min(len(self._text), self._max_stop - 1), 0, -1):
            tail = self._text[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0

    def _release(self, end: int) -> str:
        end = max(end, self._emitted)
        out = self._text[self._emitted : end]
        self._emitted = end
        return out


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
