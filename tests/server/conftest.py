"""The default server of the server tests: stories260K with ENGINE_OPTIONS and an API key (one per
module), and the same engine offline to compare against. Modules that need another set-up define
their own `server`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvgen import LLM
from kvgen.server.app import create_app
from tests.server.harness import API_KEY, ENGINE_OPTIONS, MODEL, Server, running


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(**ENGINE_OPTIONS)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    app = create_app(LLM(**ENGINE_OPTIONS).engine, model_name=MODEL, api_key=API_KEY)
    with running(app) as url:
        yield Server(url, app)
