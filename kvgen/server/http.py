"""HTTP plumbing around the routes: every error answered as an OpenAI error object, and the
request body's size limit."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvgen.errors import InvalidRequestError
from kvgen.server.limits import LimitExceededError
from kvgen.server.state import APIError, server_state


def _answer(path: str, error: APIError) -> Response:
    """The error in the shape of the API asked: Anthropic's under /v1/messages, else OpenAI's."""
    if path.startswith("/v1/messages"):
        from kvgen.server.anthropic_messages import anthropic_error

        return anthropic_error(error)
    return error.response()


def add_error_handlers(app: FastAPI) -> None:
    async def api_error(request: Request, exc: APIError) -> Response:
        return _answer(request.url.path, exc)

    async def invalid_request(request: Request, exc: InvalidRequestError) -> Response:
        if isinstance(exc, LimitExceededError):
            server_state(request).metrics.on_reject("over_limit")
        return _answer(request.url.path, APIError(400, str(exc)))

    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        described = [_describe(e) for e in exc.errors()]
        message = "; ".join(f"{param}: {text}" if param else text for param, text in described)
        return _answer(request.url.path, APIError(400, message, param=described[0][0] if described else None))

    async def http_error(request: Request, exc: HTTPException) -> Response:
        return _answer(request.url.path, APIError(exc.status_code, str(exc.detail),
                                                  type="invalid_request_error" if exc.status_code < 500
                                                  else "server_error"))

    async def server_error(request: Request, exc: Exception) -> Response:
        return _answer(request.url.path, APIError(500, f"internal error: {exc}", type="server_error"))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(InvalidRequestError, invalid_request)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, server_error)


def _describe(error: dict) -> tuple[str | None, str]:
    """(the field, e.g. "messages.0.role", or None; what is wrong) of one pydantic validation error."""
    if error["type"] == "json_invalid":
        return None, f"the body is not valid JSON: {error.get('ctx', {}).get('error', error['msg'])}"
    param = ".".join(str(part) for part in error["loc"] if part != "body")
    return param or None, error["msg"]


class BodySizeLimit:
    """ASGI middleware: 413 for a body over `max_bytes`, by its Content-Length or by what arrives."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(scope, receive, send)
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                return await self._too_large(scope, receive, send)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(bytes(body), receive), send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(413, f"the request body is over the server's limit of {self.max_bytes} bytes",
                         code="request_too_large")
        await _answer(scope.get("path", ""), error)(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands out the already-read body once, then passes through (to see disconnects)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed
