"""The subcommands that live with their subsystem, each as `register(subparsers)`.

kvgen.cli adds these after its own (generate, batch, kv-size). They build on kvgen.options, never on
kvgen.cli, so the imports run one way: cli -> commands -> subsystem cli -> options.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from kvgen.bench.cli import register as register_bench
from kvgen.chat.cli import register as register_chat
from kvgen.eval.cli import register as register_eval
from kvgen.models_cli import register as register_models
from kvgen.server.cli import register as register_serve

SUBSYSTEM_COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    register_serve, register_chat, register_bench, register_eval, register_models,
)
