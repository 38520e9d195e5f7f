"""POST /v1/cache/pin: a prompt's blocks computed (if they are not cached yet) and kept in the KV tiers
until unpinned (`"unpin": true`), as llama.cpp's slot save offers (kvgen.cache.tiers)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field

from kvgen.sampling_params import SamplingParams
from kvgen.server.state import APIError, check_api_key, server_state

router = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])


class PinRequest(BaseModel):
    prompt: str = Field(description="the prompt whose full blocks to keep (the request body's size bounds it)")
    unpin: bool = False


@router.post("/cache/pin")
async def pin(body: PinRequest, request: Request) -> dict:
    state = server_state(request)
    engine = state.engine
    if not getattr(engine, "config", None) or not engine.config.kv_tiers or not hasattr(engine, "pin_prefix"):
        raise APIError(400, "pinning needs KV tiers in this process: start the server with --kv-offload-memory "
                       "or --kv-cache-dir (and one replica)")
    try:
        admitted = engine.admission.admit(body.prompt, SamplingParams(temperature=0, max_tokens=1))
    except ValueError as error:
        raise APIError(400, str(error)) from None
    if not body.unpin:
        async for _ in state.llm.submit(admitted):  # computes (or finds) the prompt's blocks
            pass
    result = await state.llm.between_steps(lambda e: e.pin_prefix(admitted.token_ids, not body.unpin))
    return {"object": "cache.pin", "pinned": not body.unpin, "tokens": result["blocks"] * engine.config.block_size,
            **result}
