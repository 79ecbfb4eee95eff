"""A request body as the gateway keeps it through the queue and its attempts: the bytes it
forwards, less the few top-level fields it rewrites, and those fields apart.

The gateway rewrites `priority`, `vllm_xargs` (tier and tenant), `stream_options` (usage on
every stream) and `cache_salt` (the tenant's), and nothing else. Kept parsed, a body of 1 MiB
of token ids took about 7 MB while it waited in the queue, and each attempt serialized it
again on the event loop; now the rest of the body is serialized once, as compact bytes, and
each attempt splices the rewritten fields onto its end.

A body over the server's offload size is read in the body parser's process (as `tierserve
serve` reads its own): parsing and validating 1 MiB of token ids took about 54 ms of the
gateway's event loop, and with many such bodies arriving every stream waited behind them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from tierserve.gateway.prompt import estimate_prompt_tokens, prefix_key
from tierserve.server.body_parser import KINDS, Kind, first_error

# The top-level fields the gateway may rewrite: kept apart from the rest of the body.
REWRITTEN = ("priority", "vllm_xargs", "stream_options", "cache_salt")


@dataclass(frozen=True)
class ForwardBody:
    rest: bytes  # the body as JSON, without the REWRITTEN fields
    fields: dict[str, Any]  # the REWRITTEN fields the client sent, as sent
    model: str
    prefix: str  # prefix affinity's key (`prompt.prefix_key`)
    num_prompt_tokens: int  # an estimate (`prompt.estimate_prompt_tokens`)

    def encode(self, fields: dict[str, Any]) -> bytes:
        """The body to send, with `fields` (the rewritten ones, in place of `self.fields`)."""
        if not fields:
            return self.rest
        tail = _dumps(fields)[1:]  # '"priority":1,...}'
        return b"".join((memoryview(self.rest)[:-1], b"," if self.rest != b"{}" else b"", tail))


@dataclass(frozen=True)
class Summary:
    """What the gateway reads of the validated body (the body itself stays in the process
    that validated it: taking back a chat body's messages rebuilt them on the event loop)."""

    model: str
    priority: int | None
    stream: bool
    requested_max_tokens: int | None  # the client's output limit, if it set one ...
    max_tokens_field: str  # ... and the field it set it in (max_tokens or max_completion_tokens)
    prompt_field: str  # "messages" or "prompt"

    def reserved_output(self, max_tokens: int) -> tuple[int, str]:
        """As `ChatCompletionRequest.reserved_output` (the server's own reservation)."""
        if self.requested_max_tokens is not None:
            return 0, self.max_tokens_field
        return max_tokens, self.prompt_field


def _dumps(value: Any) -> bytes:
    """Compact JSON, text as UTF-8 (validation refused lone surrogates, so it encodes)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


@dataclass(frozen=True)
class Refused:
    """Why a body is refused: invalid JSON (`message`) or a field (`errors`, pydantic's first)."""

    message: str = ""
    errors: tuple[dict[str, Any], ...] = ()


Read = tuple[ForwardBody, Summary] | Refused


def read_body(kind: Kind, raw: bytes, prefix_chars: int) -> Read:
    """Parse and validate `raw` as a `kind` body (in the body parser's process for a large
    one; module-level, so it crosses by name): the body to forward and what the gateway
    reads of the validated one, or why it is refused. It is validated from its bytes first,
    as `tierserve serve` validates it, so that the server's 400s are the gateway's too: a
    lone surrogate escape ("\\ud800"), which Python's `json` lets through, is `invalid_json`."""
    try:  # first: its refusals are the server's, word for word
        body = KINDS[kind].model_validate_json(raw)
    except ValidationError as e:
        return Refused(errors=(first_error(e),))
    # An object, as validation found it. Python's JSON reader takes whatever validation takes
    # (its nesting and number limits are the lower); the except is a safety net only.
    try:
        parsed: dict[str, Any] = json.loads(raw)
    except (ValueError, RecursionError) as e:
        return Refused(f"Invalid JSON body: {e}")
    fields = {k: parsed.pop(k) for k in REWRITTEN if k in parsed}
    try:
        rest = _dumps(parsed)
        _dumps(fields)  # each attempt writes them again
    except UnicodeEncodeError:  # a lone surrogate: validation refuses them, so not seen yet
        return Refused("Invalid JSON body: a lone UTF-16 surrogate is not text.")
    except ValueError:  # an undeclared field's NaN, Infinity or 1e400, which JSON cannot hold
        return Refused("Invalid JSON body: NaN, Infinity and numbers past a double's range are not JSON.")
    forward = ForwardBody(
        rest,
        fields,
        str(parsed.get("model", "")),
        prefix_key({**parsed, **fields}, prefix_chars),
        estimate_prompt_tokens(parsed),
    )
    requested, field = body.requested_max_tokens()
    summary = Summary(body.model, body.priority, bool(body.stream), requested, field, body.prompt_field)
    return forward, summary
