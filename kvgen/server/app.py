"""The OpenAI-compatible HTTP server over AsyncLLM: `create_app(engine, model_name=...)`.

    POST /v1/completions       POST /v1/chat/completions       GET /v1/models
    POST /v1/messages (Anthropic; anthropic_messages.py)         POST /v1/responses (openai_responses.py)
    GET /health                GET /metrics (Prometheus)
    GET /dashboard             a live view of the KV cache (kvgen.server.dashboard), unless turned off

The routes live by family: completions.py, chat_completions.py, info.py (health, metrics, models)
and dashboard/routes.py. Both generation endpoints share one path (jobs.py: a validated `Job` run on
the engine as choice deltas; responses.py: deltas -> streamed chunks or one response). All state lives
on `app.state` (state.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI

from kvgen.async_llm import AsyncLLM
from kvgen.engine.base import Engine
from kvgen.engine.llm_engine import LLMEngine
from kvgen.replicas.frontend import ReplicaSet
from kvgen.server import anthropic_messages, cache, chat_completions, completions, info, openai_responses
from kvgen.server.chat import ChatTemplate
from kvgen.server.dashboard import routes as dashboard_routes
from kvgen.server.dashboard.source import DashboardSource
from kvgen.server.http import BodySizeLimit, add_error_handlers
from kvgen.server.limits import DEFAULT_MAX_QUEUED_REQUESTS, RequestLimits
from kvgen.server.metrics import ReplicaCollector, ServerMetrics
from kvgen.server.openai_responses import ResponseStore
from kvgen.server.parsers import resolve_reasoning_parser, resolve_tool_parser
from kvgen.server.state import ServerState, check_api_key

DEFAULT_MAX_REQUEST_BYTES = 1 << 20


def make_state(llm: AsyncLLM | ReplicaSet, *, model_name: str, api_key: str | None = None,
               limits: RequestLimits | None = None, max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS,
               reasoning_parser: str = "auto", tool_call_parser: str = "auto",
               responses: ResponseStore | None = None) -> ServerState:
    """What the routes read for one served model (several models: one each, kvgen.server.model_router)."""
    template = llm.tokenizer.chat_template  # the parsers read replies in the format it teaches (auto)
    replicas = ReplicaCollector(llm) if isinstance(llm, ReplicaSet) else None
    return ServerState(llm=llm, model_name=model_name, api_key=api_key, metrics=ServerMetrics(llm.engine, replicas),
                       chat_template=ChatTemplate(llm.tokenizer), limits=limits or RequestLimits(),
                       max_queued_requests=max_queued_requests,
                       reasoning_parser=resolve_reasoning_parser(reasoning_parser, template),
                       tool_parser=resolve_tool_parser(tool_call_parser, template),
                       responses=responses if responses is not None else ResponseStore())


def create_app(engine: Engine | AsyncLLM | ReplicaSet, *, model_name: str, api_key: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, limits: RequestLimits | None = None,
               max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS, dashboard: bool = True,
               reasoning_parser: str = "auto", tool_call_parser: str = "auto") -> FastAPI:
    """The server's ASGI app over an engine, an AsyncLLM already wrapping one, or data-parallel replicas
    (kvgen.replicas.ReplicaSet, which has AsyncLLM's interface). The dashboard needs the paged engine in
    this process (the one-at-a-time reference has no block pool to show; replicas keep theirs)."""
    llm = engine if isinstance(engine, (AsyncLLM, ReplicaSet)) else AsyncLLM(engine)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await llm.shutdown()

    app = FastAPI(title="kvgen", summary="OpenAI-compatible API over the kvgen engine", lifespan=lifespan)
    app.state.kvgen = make_state(llm, model_name=model_name, api_key=api_key, limits=limits,
                                 max_queued_requests=max_queued_requests, reasoning_parser=reasoning_parser,
                                 tool_call_parser=tool_call_parser)
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes)
    add_error_handlers(app)
    app.include_router(info.router)
    app.include_router(info.v1_router)
    app.include_router(completions.router)
    app.include_router(chat_completions.router)
    app.include_router(cache.router)
    app.include_router(anthropic_messages.router)
    app.include_router(openai_responses.router)
    if dashboard and (isinstance(llm, ReplicaSet) or isinstance(llm.engine, LLMEngine)):
        metrics = app.state.kvgen.metrics
        app.state.dashboard = (DashboardSource(llm, metrics) if isinstance(llm, AsyncLLM) else
                               [DashboardSource(llm, metrics, replica=i) for i in range(llm.num_replicas)])
        app.include_router(dashboard_routes.page)
        app.include_router(dashboard_routes.data, dependencies=[Depends(check_api_key)])
    return app
