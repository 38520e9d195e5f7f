"""What the server says of itself: GET /health and /metrics (open to all), GET /v1/models (behind
the API key)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvgen.server.protocol import ModelCard, ModelList
from kvgen.server.state import check_api_key, json_response, server_state

router = APIRouter()
v1_router = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])


@router.get("/health")
async def health() -> dict:
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(server_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@v1_router.get("/models")
async def models(request: Request) -> Response:
    state = server_state(request)
    return json_response(ModelList(data=[ModelCard(id=state.model_name, max_model_len=state.engine.max_model_len)]))
