"""`kvgen chat` as a user runs it: a real process, its stdin a pipe (one user turn per line)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STATS = re.compile(r"^prompt (\d+) tokens, reply (\d+) tokens, .*, KV blocks (\d+) / (\d+)(.*)$", re.MULTILINE)
STATS_LINE = re.compile(r"^prompt \d+ tokens, .*\n", re.MULTILINE)
DROPPED = "its oldest turns are dropped"


def chat(*args: object, stdin: str) -> tuple[str, str]:
    """Runs `kvgen chat ARGS` on the lines of `stdin` -> (stdout, stderr); it must exit 0."""
    done = subprocess.run([sys.executable, "-m", "kvgen", "chat", *map(str, args)], input=stdin, text=True,
                          capture_output=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return done.stdout, done.stderr


def replies_and_stats(stdout: str) -> tuple[list[str], list[tuple[int, int, int, int]]]:
    """The replies (the text before each /stats line, which the input asks for after every turn) and
    the stats lines as (prompt tokens, reply tokens, KV blocks used, KV blocks in all)."""
    stats = [tuple(map(int, m[:4])) for m in STATS.findall(stdout)]
    replies = [part.strip("\n") for part in STATS_LINE.split(stdout)[:-1]]
    return replies, stats


def test_smollm2_turns_carry_the_conversation_in_its_chat_template(smollm_gguf):
    out, err = chat("--model", smollm_gguf, "--verbose", "--max-tokens", 48, "--num-kv-blocks", 64,
                    stdin="Hi\n/stats\nWhat did I just say?\n/stats\n")
    (first, second), (first_stats, second_stats) = replies_and_stats(out)
    assert first and second
    assert "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n" in err  # the first prompt
    assert (f"<|im_start|>assistant\n{first}<|im_end|>\n<|im_start|>user\nWhat did I just say?<|im_end|>\n"
            "<|im_start|>assistant\n") in err  # the second: the first exchange, then the new turn
    prompt, reply = first_stats[:2]
    assert second_stats[0] >= prompt + reply
    assert 0 < first_stats[2] <= first_stats[3] == 64


def test_default_model_without_template_gets_role_lines(stories_bin):
    """stories260K has no chat template: the server's plain fallback, "<|role|>" lines."""
    out, err = chat("--verbose", "--max-tokens", 24, "--system", "Be brief.",
                    stdin="Hi\n/stats\nWhat did I just say?\n/stats\n/reset\nHi\n/stats\n")
    replies, stats = replies_and_stats(out)
    assert len(replies) == 3 and all(replies[:2])
    assert "prompt:\n<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n\n" in err
    assert f"<|assistant|>\n{replies[0]}\n<|user|>\nWhat did I just say?\n<|assistant|>\n" in err
    assert stats[1][0] >= stats[0][0] + stats[0][1]
    assert stats[2] == stats[0] and replies[2] == replies[0]  # after /reset: the first turn again (greedy)


def test_oldest_turns_leave_a_full_context_once_said(stories_bin, tmp_path):
    transcript = tmp_path / "chat.json"
    turns = "".join(f"Tell me about {name}.\n/stats\n" for name in ("Lily", "Tom", "Sue", "Ben"))
    out, err = chat("--max-model-len", 96, "--max-tokens", 40, "--ignore-eos",
                    stdin=turns + f"/save {transcript}\n")
    _, stats = replies_and_stats(out)
    assert all(prompt + 40 <= 96 for prompt, *_ in stats)
    assert err.count(DROPPED) == 1
    messages = json.loads(transcript.read_text())["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] * 4  # all of it, dropped turns too
    assert messages[6]["content"] == "Tell me about Ben."


def test_ctrl_c_stops_the_reply_not_the_session(smollm_gguf):
    command = [sys.executable, "-m", "kvgen", "chat", "--model", str(smollm_gguf), "--max-tokens", "400",
               "--ignore-eos", "--num-kv-blocks", "64"]
    with subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          cwd=REPO) as chat_process:
        chat_process.stdin.write(b"Tell me a long story.\n")
        chat_process.stdin.flush()
        assert os.read(chat_process.stdout.fileno(), 1)  # the reply has started streaming
        chat_process.send_signal(signal.SIGINT)
        out, err = chat_process.communicate(b"/stats\nHi\n/stats\n", timeout=600)
    assert chat_process.returncode == 0, err.decode()
    assert b"[stopped]" in err
    stopped, answered = STATS.findall(out.decode())
    assert stopped[4] == " (stopped)" and 0 < int(stopped[1]) < 400
    assert answered[4] == "" and int(answered[1]) > 0


def test_on_a_terminal_lines_are_edited_and_recalled_and_ctrl_c_stops_replies(smollm_gguf):
    """prompt_toolkit on a pseudo-terminal: Ctrl-C stops the reply, the up arrow recalls the last
    line, and Ctrl-C at the prompt ends the session."""
    pexpect = pytest.importorskip("pexpect")
    reading = re.escape("\x1b[?2004h")  # prompt_toolkit turns bracketed paste on when it waits for a line
    command = ["-m", "kvgen", "chat", "--model", str(smollm_gguf), "--max-tokens", "400", "--ignore-eos",
               "--num-kv-blocks", "64"]
    stats = r"prompt \d+ tokens, reply \d+ tokens, [^\r\n]*"  # mid-line: after the terminal's escapes
    terminal = pexpect.spawn(sys.executable, command, cwd=str(REPO), encoding="utf-8", timeout=120)
    terminal.expect(reading)
    terminal.sendline("Hi")
    terminal.expect(re.escape("\x1b[?2004l") + r"\W*\w")  # the line is taken, and the reply has begun
    terminal.sendintr()
    terminal.expect_exact("[stopped]")
    terminal.expect(reading)
    terminal.sendline("/stats")
    terminal.expect(stats)
    assert terminal.match.group(0).endswith(" (stopped)")
    terminal.expect(reading)
    terminal.send("\x1b[A\r")  # up arrow: /stats again
    terminal.expect(stats)
    terminal.expect(reading)
    terminal.sendintr()
    terminal.expect(pexpect.EOF)
    terminal.close()
    assert terminal.exitstatus == 0
