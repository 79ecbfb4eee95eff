"""OpenAI response bodies: whole responses and server-sent-event chunks.

Chunks are written from pre-serialised fragments (only the text is JSON-encoded per
chunk), because at hundreds of concurrent streams this is the API layer's hot path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    def body(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class ResponseFormatter:
    """Builds the bodies of one response; `chat` selects chat.completion vs text_completion."""

    def __init__(
        self,
        *,
        chat: bool,
        response_id: str,
        created: int,
        model: str,
        include_usage: bool,
        continuous_usage: bool = False,
    ) -> None:
        self.chat = chat
        self.response_id = response_id
        self.created = created
        self.model = model
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage  # chunks carry the usage so far, not null
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = json.dumps({"id": response_id, "object": obj, "created": created, "model": model})[:-1]
        self._head = "data: " + head + ', "choices": ['
        self._tail = "]" + (', "usage": null' if include_usage else "") + "}\n\n"

    def _choice(self, content: str | None, finish_reason: str | None, role: bool = False) -> str:
        reason = "null" if finish_reason is None else json.dumps(finish_reason)
        if self.chat:
            delta: dict[str, str] = {}
            if role:
                delta["role"] = "assistant"
            if content is not None:
                delta["content"] = content
            body = f'"delta": {json.dumps(delta)}'
        else:
            body = f'"text": {json.dumps(content or "")}'
        return f'{{"index": 0, {body}, "logprobs": null, "finish_reason": {reason}}}'

    def _end(self, usage: Usage | None) -> str:
        """A chunk's end: its usage so far where the stream carries it continuously."""
        if usage is None or not self.continuous_usage:
            return self._tail
        return '], "usage": ' + json.dumps(usage.body()) + "}\n\n"

    def first_chunk(self, usage: Usage | None = None) -> bytes:
        """Chat streams open with the assistant's role (as OpenAI's do); completions need nothing."""
        if not self.chat:
            return b""
        return (self._head + self._choice("", None, role=True) + self._end(usage)).encode()

    def text_chunk(self, text: str, usage: Usage | None = None) -> bytes:
        return (self._head + self._choice(text, None) + self._end(usage)).encode()

    def finish_chunk(self, finish_reason: str, usage: Usage | None = None) -> bytes:
        content = None if self.chat else ""
        return (self._head + self._choice(content, finish_reason) + self._end(usage)).encode()

    def usage_chunk(self, usage: Usage) -> bytes:
        body: dict[str, Any] = {
            "id": self.response_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage.body(),
        }
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    def full(self, text: str, finish_reason: str, usage: Usage) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            obj = "text_completion"
        return {
            "id": self.response_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage.body(),
        }


def error_event(message: str, type: str = "server_error", code: str | None = None) -> bytes:
    body = {"error": {"message": message, "type": type, "param": None, "code": code}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"
