"""Reading token usage out of an upstream's replies without touching the text.

A reply read whole (not streamed) is parsed once, by `read_reply`, for what the gateway
needs of it: whether it is a JSON object, OpenAI's error envelope, its usage, and the
upstream's own message for a refusal. A large one is read in the body parser's process:
the gateway's event loop carries every stream, and parsing megabytes of logprobs there
held them all.

A streamed reply is cut into whole SSE events (blank-line separated) and passed on as
received; events that mention `"usage"` are parsed to learn the count. When the client
did not ask for usage, the gateway asks the upstream anyway and drops the usage-only
event (no choices) before it reaches the client. The tap also notes whether the stream's
last word, `data: [DONE]`, came: a stream that stops without it did not run to its end.

An event is looked for in the new bytes only (a long event arriving in many chunks once
cost time quadratic in its size, on the event loop every stream shares), CRLF line ends
split between two chunks still pair up, and an event past `MAX_EVENT_BYTES` ends the
stream (`EventTooLarge`) rather than the gateway's memory.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeGuard

_NULL_USAGE = re.compile(rb'"usage"\s*:\s*null')
MAX_TOKEN_COUNT = 100_000_000  # in a reported usage: past any model's context (10M, Llama 4 Scout)
MAX_QUOTED_CHARS = 500  # of an upstream's error text, quoted in the envelope
MAX_EVENT_BYTES = 8 << 20  # one SSE event; a token's delta, even with logprobs, is a few KB


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
    if _count(prompt) and _count(completion):
        return TokenUsage(prompt, completion)
    return None


def _count(value: Any) -> TypeGuard[int]:
    """A token count: an integer (JSON's `true` is not one), from 0 to `MAX_TOKEN_COUNT`. An
    upstream's count past it, charged, left every tenant's tokens in debt for hours (and one
    of 400 digits failed the settling)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKEN_COUNT


class ReplyRead(NamedTuple):
    """What the gateway reads of a reply read whole (`read_reply`)."""

    is_object: bool  # a JSON object: a 200 that is not one is a failed attempt
    error_envelope: bool  # OpenAI's `{"error": {"message": ...}}`: passed on as written
    usage: TokenUsage | None
    message: str  # a refusal's own text (at most `MAX_QUOTED_CHARS`), "" for a 200


def read_reply(kind: str, content: bytes, status: int = 200) -> ReplyRead:
    """Read a non-streaming reply of HTTP `status` (`kind` is unused: the body parser's
    jobs take one). A refusal's text is its `message` or `detail`, else the reply itself."""
    try:
        payload = json.loads(content)
    except (ValueError, RecursionError):
        payload = None
    if not isinstance(payload, dict):
        text = "" if status == 200 else content.decode("utf-8", "replace").strip()
        return ReplyRead(False, False, None, text[:MAX_QUOTED_CHARS])
    error = payload.get("error")
    envelope = isinstance(error, dict) and isinstance(error.get("message"), str)
    if status == 200 or envelope:
        return ReplyRead(True, envelope, usage_of(payload), "")
    found = payload.get("message", payload.get("detail"))
    text = found if isinstance(found, str) else json.dumps(payload)
    return ReplyRead(True, False, None, text[:MAX_QUOTED_CHARS])


class EventTooLarge(ValueError):
    """An upstream sent an SSE event past `MAX_EVENT_BYTES`."""


class SseUsageTap:
    """Feed it raw chunks; it returns the bytes to forward (whole events) and keeps the usage."""

    def __init__(self, forward_usage: bool, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self._forward_usage = forward_usage
        self._max_event_bytes = max_event_bytes
        self._pieces: list[bytes] = []  # the bytes of the event under way, "\n" line ends
        self._size = 0
        self._cr = False  # the last chunk ended in "\r": its "\n" may start the next
        self.usage: TokenUsage | None = None
        self.done = False  # `data: [DONE]` came

    def feed(self, chunk: bytes) -> bytes:
        if self._cr:
            chunk = b"\r" + chunk
        self._cr = chunk.endswith(b"\r")
        if self._cr:
            chunk = chunk[:-1]
        chunk = chunk.replace(b"\r\n", b"\n")
        # A separator may straddle the chunks: the last byte kept and the first new one.
        joined = self._pieces[-1][-1:] + chunk if self._pieces else chunk
        if b"\n\n" not in joined:
            self._keep(chunk)
            return b""
        data = b"".join([*self._pieces, chunk])
        self._pieces, self._size = [], 0
        head, _, rest = data.rpartition(b"\n\n")
        if rest:
            self._keep(rest)
        return b"".join(self._event(e + b"\n\n") for e in head.split(b"\n\n") if e)

    def flush(self) -> bytes:
        """What is left at the end of the stream, an event without its blank line: passed on,
        ended with one, if its last line is whole (or is `data: [DONE]`); dropped if the
        stream stopped inside a line (a client would read half an event: a JSON chunk cut
        short, which the OpenAI client fails on before it reads the error event after it)."""
        rest = b"".join(self._pieces) + (b"\r" if self._cr else b"")
        self._pieces, self._size, self._cr = [], 0, False
        rest = rest.replace(b"\r\n", b"\n")
        if self.done or not rest.strip():  # nothing after `data: [DONE]` is for the client
            return b""
        if _is_done(_data_of(rest)):
            self.done = True
        elif not rest.endswith((b"\n", b"\r")):
            return b""
        return rest.rstrip(b"\r\n") + b"\n\n"

    def _keep(self, piece: bytes) -> None:
        if not piece:
            return
        self._pieces.append(piece)
        self._size += len(piece)
        if self._size > self._max_event_bytes:
            self._pieces, self._size = [], 0
            raise EventTooLarge(f"an event over {self._max_event_bytes:,} bytes")

    def _event(self, event: bytes) -> bytes:
        if self.done:
            return b""  # nothing after `data: [DONE]` is for the client
        # Most events are a token's chunk: looked into (their data copied out) only where they
        # may be the last word or carry a usage. With usage asked for, every chunk carries
        # `"usage": null` (OpenAI's format, and tierserve's and vLLM's): only one whose usage
        # is not null is worth parsing.
        if b"[DONE]" in event and _is_done(_data_of(event)):
            self.done = True
            return event
        if b'"usage"' not in event or _NULL_USAGE.search(event):
            return event
        data = _data_of(event)
        if data is None or not data.lstrip().startswith(b"{"):
            return event
        try:
            payload = json.loads(data)
        except ValueError:
            return event
        usage = usage_of(payload)
        if usage is not None:
            self.usage = usage
            if not self._forward_usage and isinstance(payload, dict) and not payload.get("choices"):
                return b""
        return event


def _is_done(data: bytes | None) -> bool:
    """Whether an event's data is the stream's last word, `[DONE]`."""
    return data is not None and data.strip() == b"[DONE]"


def _data_of(event: bytes) -> bytes | None:
    """An SSE event's data: its `data:` lines' values (one leading space dropped) joined by
    newlines; None where it has none. Other fields (`id:`, `event:`, comments) are skipped:
    a usage event sent as `data:{...}` or after an `id:` line was passed on uncounted."""
    if event.startswith(b"data: ") and event.find(b"\n") >= len(event) - 2:  # one line: the usual event
        return event[6:].rstrip(b"\n")
    values = [
        line[6:] if line.startswith(b"data: ") else line[5:]
        for line in event.rstrip(b"\n").split(b"\n")
        if line.startswith(b"data:")
    ]
    return b"\n".join(values) if values else None
