"""Reading token usage out of an upstream's replies without touching the text.

A streamed reply is cut into whole SSE events (blank-line separated) and passed on as
received; events that mention `"usage"` are parsed to learn the count. When the client
did not ask for usage, the gateway asks the upstream anyway and drops the usage-only
event (no choices) before it reaches the client. The tap also notes whether the stream's
last word, `data: [DONE]`, came: a stream that stops without it did not run to its end.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_NULL_USAGE = re.compile(rb'"usage"\s*:\s*null')
_DONE = re.compile(rb"data:\s?\[DONE\]\s*")


@dataclass(frozen=True, slots=True)
class TokenUsage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def usage_of(payload: Any) -> TokenUsage | None:
    usage = payload.get("usage") if isinstance(payload, dict) else None
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    return TokenUsage(prompt, completion)


class SseUsageTap:
    """Feed it raw chunks; it returns the bytes to forward (whole events) and keeps the usage."""

    def __init__(self, forward_usage: bool) -> None:
        self._forward_usage = forward_usage
        self._buffer = b""
        self.usage: TokenUsage | None = None
        self.done = False  # `data: [DONE]` came

    def feed(self, chunk: bytes) -> bytes:
        self._buffer += chunk.replace(b"\r\n", b"\n")
        head, sep, rest = self._buffer.rpartition(b"\n\n")
        if not sep:
            return b""
        self._buffer = rest
        return b"".join(self._event(e + b"\n\n") for e in head.split(b"\n\n") if e)

    def flush(self) -> bytes:
        """Whatever is left at the end of the stream (an event without its blank line),
        ended with one so that an event written after it stays an event of its own."""
        rest, self._buffer = self._buffer, b""
        if not rest.strip():
            return b""
        self._note_done(rest)
        return rest.rstrip(b"\n") + b"\n\n"

    def _note_done(self, event: bytes) -> None:
        if _DONE.fullmatch(event):
            self.done = True

    def _event(self, event: bytes) -> bytes:
        self._note_done(event)
        # With usage asked for, every chunk carries `"usage": null` (OpenAI's format, and
        # tierserve's and vLLM's): only one whose usage is not null is worth parsing.
        if b'"usage"' not in event or not event.startswith(b"data: {") or _NULL_USAGE.search(event):
            return event
        try:
            payload = json.loads(event[len(b"data: ") :])
        except ValueError:
            return event
        usage = usage_of(payload)
        if usage is not None:
            self.usage = usage
            if not self._forward_usage and not payload.get("choices"):
                return b""
        return event
