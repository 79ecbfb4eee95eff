"""The two generation routes, answered before FastAPI's router.

A FastAPI route resolves its parameters through the dependency machinery and wraps the
handler in several layers on every request: ~0.2 ms on this machine before `generate`
starts, on the event loop that also sends every token of every stream. This middleware
answers `POST /v1/chat/completions` and `POST /v1/completions` itself.

Order: the API key, from the headers alone (a 401 goes out before a byte of the body is
read, with `connection: close`); then the Content-Type and Content-Encoding (a body that
is not JSON by its type, or compressed, gets 415, unread); then one request from the
tenant's request buckets (a 429 when they are empty, the body unread; the charge stays
whatever the answer: ratelimit.py); then the body; then one validation pass with the
same pydantic models (`model_validate_json`) and the same `generate`. A body larger than
`OFFLOAD_BYTES` is validated in the body parser's process (body_parser.py) and prepared
on a worker thread, both through a `BodyGate` (body_gate.py, which shares its time
fairly among tenants), so the event loop keeps sending tokens meanwhile. A client gone
while sending its body is an aborted upload: one log line, a metric, nothing answered.
Errors leave as the app's handlers would send them (400 naming the field, 413, the
`ApiError` envelope); anything unexpected goes up to the app's 500 handler. The FastAPI
routes stay declared, so the OpenAPI schema documents them."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from tierserve.server.body_gate import BUSY, BodyGate
from tierserve.server.body_parser import BodyInvalid, Kind
from tierserve.server.errors import ApiError, http_error, invalid_body
from tierserve.server.generate import generate
from tierserve.server.http_guard import ABORTED_UPLOAD, REFUSED
from tierserve.server.protocol import ChatCompletionRequest, CompletionRequest
from tierserve.server.refusals import charge_request, draining_error
from tierserve.server.state import ServerState

log = logging.getLogger("tierserve.server")

Model = type[ChatCompletionRequest] | type[CompletionRequest]
ROUTES: dict[str, Model] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}
OFFLOAD_BYTES = 64 * 1024  # bodies above this are validated off the event loop


class GenerationRoutes:
    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self._app = app
        self._state = state
        server = state.config.server
        self._gate = BodyGate(
            server.large_body_share, server.large_body_queue, server.large_body_queue_per_tenant
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        model = ROUTES.get(scope["path"]) if scope["type"] == "http" else None
        if model is None or scope["method"] != "POST":
            await self._app(scope, receive, send)  # other methods get FastAPI's 405
            return
        http = HttpRequest(scope, receive)
        response = await self._respond(http, model)
        if response is not None:
            await response(scope, receive, send)

    async def _respond(self, http: HttpRequest, model: Model) -> Response | None:
        count = self._state.metrics.count_http_error
        try:
            tenant = self._state.tenants.resolve_headers(http.headers)
        except ApiError as e:
            close_if_unread(e, http)
            return refused_at_the_door(e, count)
        if (refused := unsupported_body(http)) is not None:
            return refused_at_the_door(refused, count)
        if self._state.draining:  # not worth its body: it cannot be admitted
            return self._draining()
        try:
            charged = await charge_request(self._state.limiter, tenant, self._state.metrics.reject)
        except ApiError as e:  # its request buckets are empty: its body is not worth reading
            close_if_unread(e, http)
            return e.response()
        try:
            raw = await self._state.uploads.read(http)
        except ClientDisconnect:
            aborted_upload(self._state.metrics.count_http_error, http.scope, log)
            return None
        except HTTPException as e:  # the body limit, while reading a chunked body
            return refused_at_the_door(http_error(e), count)
        if raw is None:  # the drain began while it came in
            return self._draining()
        try:
            if len(raw) > OFFLOAD_BYTES:
                kind: Kind = "chat" if model is ChatCompletionRequest else "completion"
                parser = self._state.body_parser
                job = partial(parser.parse, kind, raw)
                try:
                    body = await self._gate.admit(job, tenant.name)
                except ApiError as e:
                    if e.code not in BUSY:
                        raise
                    return refused_at_the_door(e, count)
                del raw, job  # not held through the generation beside the body parsed from it
                return await generate(self._state, http, body, tenant, charged, offload=self._gate)
            body = _validate(model, raw)
            del raw
            return await generate(self._state, http, body, tenant, charged)
        except ValidationError as e:
            return invalid_body(e.errors(include_url=False, include_input=False)).response()
        except BodyInvalid as e:
            return invalid_body(e.errors).response()
        except ApiError as e:
            return e.response()

    def _draining(self) -> Response:
        """503 `draining` for a request whose body is not (all) read: the connection closes."""
        self._state.metrics.reject("draining", None)
        return draining_error(unread=True).response()


def refused_at_the_door(e: ApiError, count: Callable[[str], None]) -> Response:
    """A refusal before the application takes the request (its key or headers, its body's
    size or encoding, no room to parse it), counted in `tierserve_http_errors_total`."""
    count(e.code or ("bad_header" if e.status == 400 else f"http_{e.status}"))
    return e.response()


def close_if_unread(e: ApiError, http: HttpRequest) -> None:
    """A refusal sent before the body is read closes the connection where the body is large
    (not worth reading to reuse it; a small one is read and skipped)."""
    if _large_body(http.headers.get("content-length"), http.headers.get("transfer-encoding")):
        e.headers.setdefault("connection", "close")


def unsupported_body(http: HttpRequest) -> ApiError | None:
    """The 415 for a body that is not JSON by its Content-Type, or compressed; None for one
    to read. A Content-Type other than JSON is refused, as FastAPI refuses it, and so is no
    Content-Type from a browser (a request with an `Origin`, or a `Sec-Fetch-Site` other than
    same-origin): a web page may POST `text/plain`, a form or an untyped body to any address
    without asking first, so a page a user of an open server on their machine opened could
    start generations on it (an attack trial and a review). Other clients may leave the
    type out. A compressed body is refused, not decompressed: its size after inflating is
    the client's to choose (a few KiB of gzip can inflate to gigabytes), and OpenAI's API
    takes none."""
    kinds = http.headers.getlist("content-type")
    if not all(_is_json(kind) for kind in kinds) or (not kinds and _from_a_browser(http)):
        shown = ", ".join(kinds)[:64] or "none"
        message = f"Content-Type {shown!r} is not supported; send the body as application/json."
        return _unread_415(http, message, "unsupported_content_type")
    # Every Content-Encoding header, as one list (a second one, `gzip` after `identity`, went
    # unread and its body was parsed as plain JSON).
    codings = [
        c.strip().lower() for value in http.headers.getlist("content-encoding") for c in value.split(",")
    ]
    if all(c in ("identity", "") for c in codings):
        return None
    encoding = ", ".join(c for c in codings if c)
    message = f"Content-Encoding {encoding!r} is not supported; send the body uncompressed."
    return _unread_415(http, message, "unsupported_content_encoding")


def _unread_415(http: HttpRequest, message: str, code: str) -> ApiError:
    e = ApiError(415, message, code=code)
    close_if_unread(e, http)  # the body is not read
    return e


def _from_a_browser(http: HttpRequest) -> bool:
    """Whether a browser sent the request from another page (it names the page's origin)."""
    site = http.headers.get("sec-fetch-site")
    return "origin" in http.headers or (site is not None and site not in ("same-origin", "none"))


def _is_json(content_type: str) -> bool:
    """`application/json`, or a `+json` type, with or without parameters (`; charset=utf-8`)."""
    media = content_type.partition(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _large_body(length: str | None, encoding: str | None) -> bool:
    if encoding is not None:
        return True
    return length is not None and (not length.isdigit() or int(length) > OFFLOAD_BYTES)


def _validate(model: Model, raw: bytes) -> ChatCompletionRequest | CompletionRequest:
    if model is ChatCompletionRequest:
        return ChatCompletionRequest.model_validate_json(raw)
    return CompletionRequest.model_validate_json(raw)


def aborted_upload(count: Callable[[str], None], scope: Scope, log: logging.Logger) -> None:
    """The client went away before its body was complete: count it and log one line."""
    if scope.get(REFUSED) is not None:
        return  # the HTTP guard ended it, and counted and logged it
    count(ABORTED_UPLOAD)
    log.info(
        "aborted upload: %s %s from %s (client gone mid-body)",
        scope["method"],
        scope["path"],
        scope.get("client"),
    )
