"""Several models behind one port (`kvgen serve --model A --model B ...`), as llama-server's router
mode and Ollama do: the request's `model` picks one; a model is loaded on first use, and when loading
it would pass the memory budget (`--model-memory`), the least recently used idle models are unloaded
first. `/v1/models` lists every model with its state (unloaded, loading, loaded).

Each loaded model has its own engine loop, chat template, parsers and metrics (a ServerState, as a
one-model server has); `select_model`, a dependency of every generation route, loads the model the
body names and routes the request to it. A model with a request in flight is never unloaded; when
every loaded model is busy, a request for another waits for them to finish (up to two minutes, then
503 and Retry-After).

A model's size is estimated before loading from its files (weights) plus the KV cache the engine
options ask for (--kv-cache-memory), and once loaded from its files and its KV pool.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvgen.async_llm import AsyncLLM
from kvgen.engine.base import Engine
from kvgen.loaders.residency import freeze_live_objects
from kvgen.server import anthropic_messages, chat_completions, completions, openai_responses
from kvgen.server.http import BodySizeLimit, add_error_handlers
from kvgen.server.state import APIError, ServerState, check_api_key

log = logging.getLogger("kvgen.server")


@dataclass
class ModelEntry:
    name: str
    path: str
    state: ServerState | None = None
    loading: bool = False
    last_used: float = 0.0
    active: int = 0  # requests routed to it that have not ended
    size: int = 0  # bytes: estimated until loaded, then measured

    @property
    def status(self) -> str:
        return "loaded" if self.state is not None else "loading" if self.loading else "unloaded"


def file_size(path: str) -> int:
    """The bytes of a model's weight files (a file, or a directory's .safetensors / .gguf / .bin)."""
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    if p.is_dir():
        return sum(f.stat().st_size for f in p.iterdir() if f.suffix in (".safetensors", ".gguf", ".bin"))
    return 0


def kv_pool_bytes(engine: Engine) -> int:
    """The KV pool of a loaded engine, where it tells (the paged engine does)."""
    tokens, per_token = getattr(engine, "capacity_tokens", 0), getattr(engine, "bytes_per_token", 0)
    return tokens * per_token if isinstance(tokens, int) and isinstance(per_token, int) else 0


class ModelRouter:
    def __init__(self, models: list[tuple[str, str]], build: Callable[[str], Engine],
                 make_state: Callable[[AsyncLLM, str], ServerState], budget: int | None = None,
                 kv_estimate: int = 0, wait: float = 120.0) -> None:
        names = [name for name, _ in models]
        if len(set(names)) != len(names):
            raise ValueError(f"two models have the same name: {names}")
        self.entries = {name: ModelEntry(name, path, size=file_size(path) + kv_estimate) for name, path in models}
        self.default = names[0]
        self.build, self.make_state, self.budget, self.wait = build, make_state, budget, wait
        self.lock = asyncio.Lock()
        self.loads = self.unloads = 0

    def entry(self, name: str | None, fallback: bool = False) -> ModelEntry:
        if name is None or (fallback and name not in self.entries):
            return self.entries[self.default]
        if name not in self.entries:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                           f"{', '.join(map(repr, self.entries))}", param="model", code="model_not_found")
        return self.entries[name]

    async def acquire(self, name: str | None, fallback: bool = False) -> ModelEntry:
        entry = self.entry(name, fallback)
        while entry.state is None:
            async with self.lock:
                if entry.state is None:
                    await self._load(entry)
        # Counted only once loaded, with no await since the check: a request still waiting for the
        # lock must not count as busy, or a load waiting for this model to go idle would wait on it.
        entry.active += 1
        entry.last_used = time.monotonic()
        return entry

    def release(self, entry: ModelEntry) -> None:
        entry.active -= 1
        entry.last_used = time.monotonic()

    async def _load(self, entry: ModelEntry) -> None:
        """Makes room (unloading idle models, least recently used first; waiting up to `wait` seconds
        for busy ones to finish), then loads the model in a thread."""
        deadline = time.monotonic() + self.wait
        while self.budget is not None and self._used() > 0 and self._used() + entry.size > self.budget:
            idle = sorted((e for e in self.entries.values() if e.state is not None and e is not entry and self._idle(e)),
                          key=lambda e: e.last_used)
            if idle:
                await self._unload(idle[0])
                continue
            if time.monotonic() > deadline:
                raise APIError(503, f"the model {entry.name!r} does not fit in the memory budget beside the "
                               "models serving requests now; retry later", type="server_busy",
                               code="model_budget_full", headers={"Retry-After": "1"})
            await asyncio.sleep(0.05)
        entry.loading = True
        try:
            log.info("loading model %s from %s", entry.name, entry.path)
            engine = await asyncio.to_thread(self.build, entry.path)
            entry.state = self.make_state(AsyncLLM(engine), entry.name)
            entry.size = file_size(entry.path) + kv_pool_bytes(engine)
            self.loads += 1
        finally:
            entry.loading = False

    @staticmethod
    def _idle(entry: ModelEntry) -> bool:
        stats = entry.state.engine.stats()
        return entry.active == 0 and stats.num_running == 0 and stats.num_waiting == 0

    async def _unload(self, entry: ModelEntry) -> None:
        log.info("unloading model %s (least recently used)", entry.name)
        state, entry.state = entry.state, None
        await state.llm.shutdown()
        del state
        freeze_live_objects()
        self.unloads += 1

    def _used(self) -> int:
        return sum(e.size for e in self.entries.values() if e.state is not None or e.loading)

    async def shutdown(self) -> None:
        for entry in self.entries.values():
            if entry.state is not None:
                await entry.state.llm.shutdown()

    def cards(self) -> list[dict[str, Any]]:
        return [{"id": e.name, "object": "model", "created": 0, "owned_by": "kvgen", "status": e.status,
                 "size_bytes": e.size, **({"max_model_len": e.state.engine.max_model_len} if e.state else {})}
                for e in self.entries.values()]


async def select_model(request: Request) -> AsyncIterator[None]:
    """Routes the request to the model its body names (loading it first), after the API key check
    (an anonymous request must not load a model). Under /v1/messages an unknown name goes to the
    first model: agents send their own model names."""
    router: ModelRouter = request.app.state.router
    await check_api_key(request)
    model = None
    if request.method == "POST":
        try:
            body = await request.json()
        except ValueError:
            body = None
        model = body.get("model") if isinstance(body, dict) and isinstance(body.get("model"), str) else None
    entry = await router.acquire(model, fallback=request.url.path.startswith("/v1/messages"))
    request.state.kvgen = entry.state
    try:
        yield
    finally:
        router.release(entry)


def create_router_app(router: ModelRouter, *, api_key: str | None, max_request_bytes: int) -> FastAPI:
    """The server's app over several models (no dashboard: it shows one engine's pool)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await router.shutdown()

    app = FastAPI(title="kvgen", summary="OpenAI- and Anthropic-compatible API over several kvgen models",
                  lifespan=lifespan)
    app.state.router = router
    app.state.kvgen = SimpleNamespace(api_key=api_key)  # what routes read before a model is chosen
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes)
    add_error_handlers(app)
    info = APIRouter()

    @info.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @info.get("/metrics")
    async def metrics(model: str | None = None) -> Response:
        """The metrics of `model`, else of the most recently used loaded model."""
        loaded = sorted((e for e in router.entries.values() if e.state is not None), key=lambda e: e.last_used)
        chosen = router.entry(model) if model is not None else (loaded[-1] if loaded else None)
        text = chosen.state.metrics.render() if chosen is not None and chosen.state is not None else b""
        text += (f"# TYPE kvgen_model_loads_total counter\nkvgen_model_loads_total {router.loads}\n"
                 f"# TYPE kvgen_model_unloads_total counter\nkvgen_model_unloads_total {router.unloads}\n").encode()
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @info.get("/v1/models", dependencies=[Depends(check_api_key)])
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": router.cards()})

    app.include_router(info)
    for module in (completions, chat_completions, anthropic_messages, openai_responses):
        app.include_router(module.router, dependencies=[Depends(select_model)])
    return app
