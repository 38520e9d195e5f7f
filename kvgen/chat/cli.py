"""`kvgen chat`: talk to the model in the terminal, its reply streamed as it is generated.

On a terminal, lines are read with prompt_toolkit (line editing, history with the arrow keys); from
a pipe, each line is one user turn. Lines starting with "/" are commands (COMMANDS). Replies go to
stdout, notes to stderr. Ctrl-C while the model replies stops the reply; at the prompt (or EOF) it
ends the session.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from pathlib import Path

from kvgen.chat.session import ChatSession, ReplyStats
from kvgen.errors import InvalidRequestError, KVGenError
from kvgen.loaders.residency import freeze_live_objects
from kvgen.options import add_engine_options, add_sampling_options, build_engine_from_args, sampling_params

COMMANDS = {
    "/reset": "forget the conversation (the system message stays)",
    "/system": "TEXT: the system message from the next turn on (no TEXT: none)",
    "/save": "FILE: write the transcript as JSON ({'messages': [...]}, as /v1/chat/completions takes it)",
    "/stats": "the last reply's tokens/s and prompt tokens, and the KV blocks it used",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    epilog = "commands: " + "; ".join(f"{name} {what}" for name, what in COMMANDS.items())
    chat = subparsers.add_parser("chat", help="chat with the model in the terminal, replies streamed",
                                 epilog=epilog)
    chat.add_argument("--system", help="the system message")
    chat.add_argument("--verbose", action="store_true", help="print each turn's prompt, as rendered, to stderr")
    add_engine_options(chat)
    add_sampling_options(chat)
    chat.set_defaults(func=cmd_chat)


def cmd_chat(args: argparse.Namespace) -> int:
    params = sampling_params(args)  # a bad parameter is reported before the model is loaded
    session = ChatSession(build_engine_from_args(args), params, args.system)
    freeze_live_objects()
    told_of_drops = False
    try:
        for line in _lines(sys.stdin.isatty()):
            if line.startswith("/"):
                _command(session, line)
            elif line.strip():
                _turn(session, line, args.verbose)
                if session.dropped_turns and not told_of_drops:
                    _note("the conversation no longer fits the context: its oldest turns are dropped from the "
                          "prompt from now on (/save still writes them)")
                    told_of_drops = True
    except KeyboardInterrupt:  # at the prompt: the end of the session
        print(file=sys.stderr)
    return 0


def _lines(tty: bool) -> Iterator[str]:
    """The user's lines until EOF: prompt_toolkit on a terminal, plain lines from a pipe."""
    if not tty:
        yield from (line.rstrip("\r\n") for line in sys.stdin)
        return
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import InMemoryHistory

    prompt = PromptSession(history=InMemoryHistory())
    while True:
        try:
            yield prompt.prompt("> ")
        except EOFError:
            return


def _turn(session: ChatSession, text: str, verbose: bool) -> None:
    """Streams the reply to the user's line; Ctrl-C stops it (what it said so far stays)."""
    try:
        pieces = session.reply(text)
    except InvalidRequestError as e:
        _note(str(e))
        return
    if verbose:
        _note(f"prompt:\n{session.last_prompt}")
    try:
        with _ctrl_c_as_flag() as interrupted, closing(pieces):
            for piece in pieces:
                print(piece, end="", flush=True)
                if interrupted():
                    break
    except KVGenError as e:  # the engine failed the reply: the session goes on
        _note(str(e))
    print(flush=True)
    if session.last_stats.stopped:
        _note("[stopped]")


@contextmanager
def _ctrl_c_as_flag() -> Iterator[Callable[[], bool]]:
    """While a reply streams, Ctrl-C sets a flag, read between engine steps, instead of raising
    KeyboardInterrupt in the middle of one."""
    hit = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: hit.set())
    try:
        yield hit.is_set
    finally:
        signal.signal(signal.SIGINT, previous)


def _command(session: ChatSession, line: str) -> None:
    name, _, rest = line.partition(" ")
    rest = rest.strip()
    if name == "/reset":
        session.reset()
        _note("the conversation is forgotten")
    elif name == "/system":
        session.set_system(rest)
        _note(f"system message: {rest}" if rest else "no system message")
    elif name == "/save" and rest:
        _save(session, Path(rest))
    elif name == "/stats":
        print(_stats_line(session.last_stats), flush=True)
    else:
        _note(f"unknown command {line!r}; commands: {', '.join(COMMANDS)} (/save takes a file)")


def _save(session: ChatSession, path: Path) -> None:
    try:
        path.write_text(json.dumps(session.transcript(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    except OSError as e:
        _note(f"cannot write {path}: {e.strerror}")
        return
    _note(f"transcript written to {path}")


def _stats_line(stats: ReplyStats | None) -> str:
    """One line a person reads and a test parses: `prompt N tokens, reply N tokens, ...`."""
    if stats is None:
        return "no reply yet"
    speed = f"{stats.decode_tokens_per_s:.1f} tokens/s" if stats.decode_tokens_per_s else "- tokens/s"
    ttft = f"{stats.ttft_s:.3f} s" if stats.ttft_s is not None else "-"
    return (f"prompt {stats.prompt_tokens} tokens, reply {stats.reply_tokens} tokens, {speed}, TTFT {ttft}, "
            f"KV blocks {stats.kv_blocks_used} / {stats.kv_blocks_total}" + (" (stopped)" if stats.stopped else ""))


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
