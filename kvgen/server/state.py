"""What every route reads: the server's state on `app.state`, its errors as OpenAI error objects,
and the API key check."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from kvgen.async_llm import AsyncLLM
from kvgen.engine.base import Engine
from kvgen.replicas.frontend import ReplicaSet
from kvgen.server.chat import ChatTemplate
from kvgen.server.limits import RequestLimits
from kvgen.server.metrics import ServerMetrics
from kvgen.server.protocol import ErrorInfo, ErrorResponse, SamplingRequest


@dataclass
class ServerState:
    llm: AsyncLLM | ReplicaSet  # the engine loop, or data-parallel replicas behind the same interface
    model_name: str
    api_key: str | None
    metrics: ServerMetrics
    chat_template: ChatTemplate
    limits: RequestLimits
    max_queued_requests: int
    reasoning_parser: str | None = None  # kvgen.server.parsers: how replies are read (None: no reasoning)
    tool_parser: str = "json"
    responses: Any = None  # /v1/responses' store of earlier responses (kvgen.server.openai_responses)

    @property
    def engine(self) -> Engine:
        return self.llm.engine

    def admit(self, body: SamplingRequest, num_prompts: int) -> None:
        """Checks a request before any work is done on it: its fields against the server's limits
        (400), then backpressure: past `max_queued_requests` sequences waiting, a new request gets 429
        and Retry-After instead of growing the queue (as vLLM and TGI do)."""
        body.check_limits(self.limits, num_prompts)
        if self.llm.num_waiting() >= self.max_queued_requests:
            self.metrics.on_reject("queue_full")
            raise APIError(429, f"the server is busy: {self.max_queued_requests} requests are already queued; "
                           "retry later", type="server_busy", code="queue_full", headers={"Retry-After": "1"})


class APIError(Exception):
    """An error answered with an OpenAI-style error object and an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers

    def response(self) -> Response:
        return json_response(ErrorResponse(error=self.info), self.status, self.headers)


def json_response(model: BaseModel, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json", headers=headers)


def server_state(request: Request) -> ServerState:
    """The state of the model the request was routed to (several models), else the app's one."""
    return getattr(request.state, "kvgen", None) or request.app.state.kvgen


def serving_state(request: Request, model: str | None) -> ServerState:
    """The app's state, once the request names the served model (or none)."""
    state = server_state(request)
    if model is not None and model != state.model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {state.model_name!r}",
                       param="model", code="model_not_found")
    return state


async def check_api_key(request: Request) -> None:
    """The key as a bearer token, or in Anthropic's `x-api-key` header."""
    key = server_state(request).api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    sent = token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "")
    if not secrets.compare_digest(sent.encode(), key.encode()):
        raise APIError(401, "missing or incorrect API key: send the header 'Authorization: Bearer <key>' "
                       "(or 'x-api-key: <key>')", code="invalid_api_key")
