"""`kvgen serve`: the OpenAI-compatible server on uvicorn (registered through kvgen.commands)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from kvgen.cache.sizing import parse_bytes
from kvgen.errors import KVGenError
from kvgen.loaders.residency import freeze_live_objects
from kvgen.options import add_engine_options, build_engine_from_args
from kvgen.server.limits import DEFAULT_MAX_QUEUED_REQUESTS, RequestLimits

ROUTERS = ("prefix", "round-robin")  # kvgen.replicas.frontend.ROUTERS (not imported here: the parser stays light)

# Each request limit is an option of the same name (--max-n ...); a request over one gets a 400.
LIMIT_HELP = {
    "max_n": "completions per prompt (n)",
    "max_prompts": "prompts in one /v1/completions request",
    "max_choices": "n x the number of prompts",
    "max_tokens": "max_tokens / max_completion_tokens",
    "max_prompt_tokens": "tokens in one prompt (default: the model's context)",
    "max_logprobs": "logprobs / top_logprobs / prompt_logprobs alternatives per token",
    "max_stop": "stop strings",
    "max_stop_length": "characters in one stop string",
    "max_stop_token_ids": "entries in stop_token_ids",
    "max_logit_bias": "entries in logit_bias",
    "max_grammar_size": "characters in a structured output's schema (as JSON), regex or choices",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    serve.add_argument("model_arg", nargs="?", metavar="MODEL", help="the same as --model, as vLLM takes it")
    g = serve.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=os.environ.get("KVGEN_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 and /dashboard's data "
                        "(default: $KVGEN_API_KEY, else no key)")
    g.add_argument("--served-model-name", help="the model's name in the API (default: the model file's name)")
    g.add_argument("--max-request-bytes", type=parse_bytes, default="1MiB",
                   help="largest request body accepted, e.g. 64KiB (default: 1MiB)")
    g.add_argument("--no-dashboard", action="store_true",
                   help="do not serve /dashboard, the live view of the KV cache")
    g.add_argument("--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED_REQUESTS,
                   help=f"sequences waiting for the engine past which new requests get 429 "
                        f"(default: {DEFAULT_MAX_QUEUED_REQUESTS})")
    g.add_argument("--reasoning-parser", default="auto", metavar="auto|none|NAME",
                   help="how a reply's reasoning is read apart from its content: think (<think>...</think>: "
                        "Qwen3, Qwen3.5, DeepSeek-R1), harmony (gpt-oss), none (default: auto, from the chat template)")
    g.add_argument("--tool-call-parser", default="auto", metavar="auto|NAME",
                   help="the format tool calls are read in: hermes, qwen3-xml, llama3-json, harmony, json "
                        "(default: auto, from the chat template)")
    dp = serve.add_argument_group("data-parallel replicas (docs/serving.md)")
    dp.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                    help="engine processes on this machine, each with its own KV pool and cores (default: 1, "
                         "the engine runs in the server's process)")
    dp.add_argument("--threads-per-replica", type=int, metavar="T",
                    help="cores (and torch threads) per replica (default: this process's cores / N; with "
                         "--ray-address, the Ray cluster's CPUs / N)")
    dp.add_argument("--router", choices=ROUTERS,
                    help="how a request picks its replica: prefix (default: the replica that served the "
                         "longest prefix of its prompt, unless it is loaded) or round-robin")
    dp.add_argument("--ray-address", metavar="ADDR",
                    help="run the replicas as Ray actors on the Ray cluster at ADDR, spread over its nodes "
                         "(pip install 'kvgen[ray]'): HOST:PORT of its head, 'auto' for the cluster started "
                         "on this machine with `ray start --head`, 'local' for a private one-machine cluster")
    limits = serve.add_argument_group("request limits (a request over one gets a 400 naming it)")
    defaults = RequestLimits()
    for name, what in LIMIT_HELP.items():
        default = getattr(defaults, name)
        limits.add_argument("--" + name.replace("_", "-"), type=int, default=default,
                            help=what + ("" if default is None else f" (default: {default})"))
    g.add_argument("--model-memory", type=parse_bytes, metavar="BYTES",
                   help="with several --model: the memory the loaded models may take together, e.g. 8GiB; "
                        "the least recently used idle one is unloaded to make room (default: no limit)")
    add_engine_options(serve)
    for action in serve._actions:  # --model is repeatable here: several models behind one port
        if "--model" in action.option_strings:
            action.__class__ = argparse._AppendAction
            action.help += "; repeat it (or NAME=PATH) to serve several models, chosen by the request's model"
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from kvgen.server.app import create_app

    models = ([args.model_arg] if args.model_arg else []) + [m for m in args.model or [] if m != args.model_arg]
    if len(models) > 1:
        return _serve_several(args, models)
    args.model = models[0] if models else None
    if args.data_parallel_size != 1:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
        engine = _replicas(args)
    elif args.threads_per_replica is not None or args.router is not None or args.ray_address is not None:
        raise KVGenError("--threads-per-replica, --router and --ray-address need --data-parallel-size N with N > 1")
    else:
        engine = build_engine_from_args(args)  # prints the KV capacity
        freeze_live_objects()
        logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    limits = RequestLimits(**{name: getattr(args, name) for name in LIMIT_HELP})
    app = create_app(engine, model_name=args.served_model_name or _model_name(args.model),
                     api_key=args.api_key, max_request_bytes=args.max_request_bytes, limits=limits,
                     max_queued_requests=args.max_queued_requests, dashboard=not args.no_dashboard,
                     reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info"))
    one_engine = args.data_parallel_size == 1
    if one_engine:  # an engine that breaks (its tensor-parallel group did) ends the server, gracefully:
        engine.on_failure = lambda _: setattr(server, "should_exit", True)  # the failed answers go out first
    try:
        server.run()  # SIGTERM / ^C: uvicorn shuts down, and the app's shutdown stops the replicas
    finally:
        if args.data_parallel_size != 1:
            engine.close()
    if one_engine and engine.failure:
        raise KVGenError(engine.failure)
    return 0


def _serve_several(args: argparse.Namespace, models: list[str]) -> int:
    """Several models behind one port (kvgen.server.model_router), each loaded on first use."""
    import uvicorn

    from kvgen.llm import open_engine
    from kvgen.options import engine_config
    from kvgen.server.app import make_state
    from kvgen.server.model_router import ModelRouter, create_router_app
    from kvgen.server.openai_responses import ResponseStore

    if args.data_parallel_size != 1 or args.served_model_name:
        raise KVGenError("several --model: name each as NAME=PATH (not --served-model-name); no --data-parallel-size")
    named = [m.split("=", 1) if "=" in m and "/" not in m.split("=", 1)[0] else [_model_name(m), m] for m in models]
    config = engine_config(args)
    limits = RequestLimits(**{name: getattr(args, name) for name in LIMIT_HELP})

    def build(path: str):  # noqa: ANN202 - an Engine
        engine = open_engine(path, config, args.tokenizer, args.gguf_file)[0]
        freeze_live_objects()
        return engine

    responses = ResponseStore()  # one store for all models: it outlives a model's unloading

    def state(llm, name: str):  # noqa: ANN202 - a ServerState
        return make_state(llm, model_name=name, api_key=args.api_key, limits=limits,
                          max_queued_requests=args.max_queued_requests, reasoning_parser=args.reasoning_parser,
                          tool_call_parser=args.tool_call_parser, responses=responses)

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    router = ModelRouter([(n, p) for n, p in named], build, state, budget=args.model_memory,
                         kv_estimate=args.kv_cache_memory or 0)
    print(f"{len(named)} models, loaded on first use: {', '.join(n for n, _ in named)}", file=sys.stderr)
    app = create_router_app(router, api_key=args.api_key, max_request_bytes=args.max_request_bytes)
    uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info")).run()
    return 0


def _replicas(args: argparse.Namespace):  # noqa: ANN202 - a ReplicaSet (imported here: it loads torch)
    from kvgen.options import engine_config
    from kvgen.replicas.frontend import ReplicaSet

    replicas = ReplicaSet(model=args.model, config=engine_config(args), num_replicas=args.data_parallel_size,
                          threads_per_replica=args.threads_per_replica, router=args.router or "prefix",
                          tokenizer=args.tokenizer, gguf_file=args.gguf_file, ray_address=args.ray_address)
    print(f"{args.data_parallel_size} replicas on {' | '.join(replicas.launcher.placements)}, "
          f"router {replicas.router.name}; each one's {replicas.engine.capacity_report()}", file=sys.stderr)
    return replicas


def _model_name(model: str | None) -> str:
    """stories260K for .../stories260K.bin, the directory's name for a Hugging Face directory."""
    from kvgen.llm import default_model_path

    path = Path(model) if model else default_model_path()
    return path.name if path.is_dir() else path.stem
