"""The dashboard's routes. The page and its script are static and hold no data, so they are served
to anyone (a browser cannot send a bearer header when it navigates); the data routes sit behind the
server's API key, which the page asks for once and sends as a header.

    GET /dashboard                   the page; /dashboard/static/dashboard.{js,css} its script and style
    GET /dashboard/state             a snapshot now; ?snapshot=ID one of the last few; ?compact=1 the
                                     event stream's pool encoding
    GET /dashboard/events            server-sent events: `event: state` with a compact snapshot

With data-parallel replicas each takes `?replica=i` (default 0): that replica's pool.
"""

from __future__ import annotations

import asyncio
import functools
import json
from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException

from kvgen.server.dashboard.source import DashboardSource
from kvgen.server.dashboard.state import state_json

STATIC = {"index.html": "text/html; charset=utf-8", "dashboard.js": "text/javascript; charset=utf-8",
          "dashboard.css": "text/css; charset=utf-8"}

page = APIRouter()
data = APIRouter(prefix="/dashboard")


def _source(request: Request) -> DashboardSource:
    """The app's source, or with data-parallel replicas (a list, one per replica) `?replica=i`'s."""
    sources = request.app.state.dashboard
    if not isinstance(sources, list):
        return sources
    replica = request.query_params.get("replica", "0")
    if not replica.isdigit() or int(replica) >= len(sources):
        raise HTTPException(404, f"no replica {replica!r}: this server has {len(sources)} (?replica=0 to "
                                 f"{len(sources) - 1})")
    return sources[int(replica)]


@functools.cache
def _static_text(name: str) -> str:
    return resources.files(__package__).joinpath("static", name).read_text(encoding="utf-8")


def _static(name: str) -> Response:
    return Response(_static_text(name), media_type=STATIC[name], headers={"Cache-Control": "no-cache"})


@page.get("/dashboard", include_in_schema=False)
async def dashboard_page() -> Response:
    return _static("index.html")


@page.get("/dashboard/static/{name}", include_in_schema=False)
async def dashboard_asset(name: str) -> Response:
    if name not in STATIC or name == "index.html":
        return Response(status_code=404)
    return _static(name)


@data.get("/state")
async def dashboard_state(request: Request, snapshot: int | None = None, compact: bool = False) -> Response:
    source = _source(request)
    if snapshot is None:
        snap = await source.take()
    elif (snap := source.recent(snapshot)) is None:
        raise HTTPException(404, f"snapshot {snapshot} is no longer kept (only the last few are)")
    # Formatting a 100,000-block pool as JSON lists takes tens of ms: off the event loop.
    body = await asyncio.to_thread(lambda: json.dumps(state_json(snap, compact), separators=(",", ":")))
    return Response(body, media_type="application/json", headers={"Cache-Control": "no-store"})


@data.get("/events")
async def dashboard_events(request: Request) -> StreamingResponse:
    return StreamingResponse(_source(request).events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})
