"""The two generation routes, answered before FastAPI's router.

A FastAPI route resolves its parameters through the dependency machinery and wraps the
handler in several layers on every request: ~0.2 ms on this machine before `generate`
starts, on the event loop that also sends every token of every stream. This middleware
answers `POST /v1/chat/completions` and `POST /v1/completions` itself: it reads the body,
validates it with the same pydantic models in one pass (`model_validate_json`) and calls
the same `generate`. Errors leave as the app's handlers would send them (400 naming the
field, 413, the `ApiError` envelope); anything unexpected goes up to the app's 500
handler. The FastAPI routes stay declared, so the OpenAPI schema documents them.
"""

from __future__ import annotations

from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from tierserve.server.errors import ApiError, http_error, invalid_body
from tierserve.server.generate import generate
from tierserve.server.protocol import ChatCompletionRequest, CompletionRequest
from tierserve.server.state import ServerState

ROUTES: dict[str, type[ChatCompletionRequest] | type[CompletionRequest]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}


class GenerationRoutes:
    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self._app = app
        self._state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        model = ROUTES.get(scope["path"]) if scope["type"] == "http" else None
        if model is None or scope["method"] != "POST":
            await self._app(scope, receive, send)  # other methods get FastAPI's 405
            return
        http = HttpRequest(scope, receive)
        response = await self._respond(http, model)
        await response(scope, receive, send)

    async def _respond(self, http: HttpRequest, model: type[BaseModel]) -> Response:
        try:
            body = model.model_validate_json(await http.body())
            assert isinstance(body, ChatCompletionRequest | CompletionRequest)
            return await generate(self._state, http, body)
        except ValidationError as e:
            return invalid_body(e.errors()).response()
        except ApiError as e:
            return e.response()
        except HTTPException as e:  # the body limit, while reading a chunked body
            return http_error(e).response()
