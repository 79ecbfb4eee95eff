"""Errors in OpenAI's envelope: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from starlette.exceptions import HTTPException
from starlette.responses import Response


class ApiError(Exception):
    """An error a handler returns to the client; never a 500.

    `extra` adds fields inside the error object (e.g. `retry_after`, `current_queue_depth`).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        self.extra = dict(extra or {})

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {
            "message": self.message,
            "type": self.type,
            "param": self.param,
            "code": self.code,
        }
        error.update(self.extra)
        return {"error": error}

    def response(self) -> Response:
        return Response(
            json.dumps(self.body()),
            status_code=self.status,
            headers=self.headers,
            media_type="application/json",
        )


def bad_request(message: str, param: str | None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, code="invalid_api_key")


def http_error(exc: HTTPException) -> ApiError:
    """Starlette's HTTP errors (404, 405; 413 and 503 from the body limit) in the envelope."""
    code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large", 503: "busy"}.get(
        exc.status_code
    )
    kind = "server_error" if exc.status_code >= 500 else "invalid_request_error"
    return ApiError(exc.status_code, str(exc.detail), type=kind, code=code, headers=exc.headers)


def invalid_body(errors: Sequence[Mapping[str, Any]]) -> ApiError:
    """A 400 naming the first invalid field of a body that failed validation (pydantic's or
    FastAPI's error list, `pick_error`); invalid JSON has a message of its own."""
    first = pick_error(errors) if errors else {}
    if first.get("type") == "json_invalid":
        why = str(first.get("ctx", {}).get("error", "cannot parse"))
        if "hex escape" in why:
            # The parser's words for a lone UTF-16 surrogate (a string cut inside an emoji,
            # "\ud83d" without its pair) as much as for a short escape: say both.
            why += (
                " (a \\u escape takes four hex digits, and a UTF-16 surrogate (\\ud800-\\udfff) "
                "must come in a high-low pair: a lone one is not text)"
            )
        return ApiError(400, f"Invalid JSON body: {why}", code="invalid_json")
    param = _param(tuple(first.get("loc", ())))
    message = first.get("msg", "invalid request")
    return ApiError(400, f"{param}: {message}" if param else message, param=param)


# How a 400 names the members of a union field that is validated as every member (pydantic
# names them by their types). The prompt, a message's content and `stop` are validated as the
# one form their value has (protocol.py) and report that form's own error.
_MEMBERS = {"str": "a string", "dict[str,any]": "an object"}


def quoted(value: object) -> str:
    """A value as an error message quotes it: its repr, cut to 64 characters (a model id in a
    path may carry kilobytes, and a 404 echoed them all)."""
    text = repr(value)
    return text if len(text) <= 64 else text[:61] + "..."


def pick_error(errors: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The error a 400 reports: the first, or where the first is one of the errors the members
    of a union field gave, one saying what the field takes (the first member's alone said
    `tool_choice: Input should be a valid string` of a field that takes an object too)."""
    loc = tuple(errors[0].get("loc", ()))
    at = next((i for i, part in enumerate(loc) if part in _MEMBERS), None)
    if at is None:
        return errors[0]
    field = loc[:at]
    members = dict.fromkeys(
        str(e["loc"][at]) for e in errors if len(e.get("loc", ())) > at and tuple(e["loc"][:at]) == field
    )
    if len(members) < 2 or any(m not in _MEMBERS for m in members):
        return errors[0]
    return {
        "type": "union_type",
        "loc": field,
        "msg": f"Input should be {_either([_MEMBERS[m] for m in members])}",
    }


def _either(names: list[str]) -> str:
    """Names joined as a list in words: "a", "a or b", "a, b, or c"."""
    if len(names) < 3:
        return " or ".join(names)
    return ", ".join(names[:-1]) + ", or " + names[-1]


def _param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "header", "query")]
    # pydantic names union members (e.g. "str", "list[TextPart]") in the path; keep field names only.
    fields = [
        p for p in parts if not (p[:1].islower() and ("[" in p or p in ("str", "int", "float", "bool")))
    ]
    return ".".join(fields) or None
