"""The server on a two-rank engine passes the server tests' main cases: the official client against
the offline single-process engine, streaming, n = 2, 64 concurrent streams, and a disconnect that
aborts its request and frees its blocks (the cases are tests/server/test_server.py's own)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvgen import LLM
from kvgen.server.app import create_app
from tests.server.harness import API_KEY, ENGINE_OPTIONS, MODEL, Server, running
from tests.server.test_server import (  # noqa: F401 - collected here, on the fixtures below
    client,
    test_64_concurrent_streams_match_offline,
    test_chat_matches_offline_greedy,
    test_completion_matches_offline_greedy,
    test_disconnect_mid_stream_frees_blocks,
    test_prompt_forms_and_n,
)


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(**ENGINE_OPTIONS)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    llm = LLM(**ENGINE_OPTIONS, tensor_parallel_size=2)
    app = create_app(llm.engine, model_name=MODEL, api_key=API_KEY)
    with running(app) as url:
        yield Server(url, app)
    llm.close()
