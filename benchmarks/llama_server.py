"""llama.cpp's own `llama-server` as a peer: how llama.cpp users serve concurrent requests.

The server runs as a child process on a loopback port, on a GGUF of the same weights, with
`--parallel N` slots (continuous batching across them) and the bench's thread count;
`llama-server-draft` adds llama.cpp's own draft-model speculation (`--model-draft`, the draft kvgen
speculates with, `--spec-draft-n-max` its K, llama-server's other speculation defaults). `run_at`
starts it with N = the batch size under test and sends every request at once, as `kvgen bench
throughput` does to kvgen; the server queues what does not fit in its slots. Prompts go as token
ids to `/completion`, greedy, EOS ignored, prompt cache off, and each answer must carry the
requested number of tokens.

The binary: `$KVGEN_LLAMA_SERVER`, else `llama-server` beside the llama.cpp libraries that
llama-cpp-python loads (`$LLAMA_CPP_LIB_PATH`, the same build), else on PATH (benchmarks.llama_tools).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import llama_tools
from kvgen.bench.latency import gguf_matmul_bytes
from benchmarks.models import BenchModel, gguf_for
from kvgen.bench.system import BenchRequest, PeerUnavailable, System, TokenTimes
from kvgen.threads import foreign_environment

START_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 1800.0


def find_binary() -> Path:
    """The llama-server to run (see benchmarks.llama_tools.find_binary); PeerUnavailable if there is none."""
    try:
        return llama_tools.find_binary("llama-server")
    except llama_tools.ToolError as e:
        raise PeerUnavailable(str(e)) from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Draft:
    """The draft model and K of kvgen's draft speculation, for the peer that speculates as llama.cpp does."""

    gguf: Path
    k: int


class LlamaServerSystem(System):
    name = "llama-server"
    batched = True
    batch_kind = "slot count"

    def __init__(self, model: BenchModel, dtype: str, max_len: int, device: str) -> None:
        self.binary = find_binary()
        self.gguf = gguf_for(model, dtype)
        self.max_len = max_len
        self.threads = torch.get_num_threads()
        self.slots = 0
        self.last_timings: dict = {}  # the server's own timings of the last timed request
        self._process: subprocess.Popen | None = None
        self._url = ""

    # -- the System operations ---------------------------------------------------------------------

    def weight_bytes(self) -> int:
        return gguf_matmul_bytes(self.gguf)

    def generate_timed(self, prompt: list[int], output_len: int) -> TokenTimes:
        self._serve(max(self.slots, 1))
        times: list[float] = []
        start = time.monotonic()
        with self._post(prompt, output_len, stream=True) as response:
            for line in response:
                event = json.loads(line[6:]) if line.startswith(b"data: ") else {}
                if event.get("content") is not None:
                    times.append(time.monotonic())
                self.last_timings = event.get("timings", self.last_timings)
        return TokenTimes(start, times[:output_len])

    def run_batch(self, requests: Sequence[BenchRequest]) -> None:
        """Every request at once, on the slots the server runs with."""
        self._serve(max(self.slots, 1))
        with ThreadPoolExecutor(max_workers=len(requests)) as pool:
            counts = list(pool.map(self._complete, requests))
        short = [(i, n) for i, (n, r) in enumerate(zip(counts, requests)) if n != r.output_len]
        if short:
            raise RuntimeError(f"llama-server stopped requests before n_predict (index, tokens): {short[:3]}")

    def run_at(self, requests: Sequence[BenchRequest], size: int) -> None:
        """The requests against a server with `size` slots (restarted if it had another count)."""
        self._serve(size)
        self.run_batch(requests)

    # -- the server process ------------------------------------------------------------------------

    def _serve(self, slots: int) -> None:
        if self._process is not None and self.slots == slots and self._process.poll() is None:
            return
        self._stop()
        port = free_port()
        command = self._server_args(slots, port)
        env = foreign_environment() | {"LD_LIBRARY_PATH": f"{self.binary.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
        self._process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        weakref.finalize(self, _terminate, self._process)
        self._url, self.slots = f"http://127.0.0.1:{port}", slots
        self._wait_healthy()

    def _server_args(self, slots: int, port: int) -> list[str]:
        return [str(self.binary), "--model", str(self.gguf), "--host", "127.0.0.1", "--port", str(port),
                "--parallel", str(slots), "--ctx-size", str(slots * self.max_len), "--threads", str(self.threads),
                "--threads-batch", str(self.threads), "--cont-batching", "--no-webui"]

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise PeerUnavailable(f"llama-server exited with code {self._process.returncode} at start-up "
                                      f"({self.binary} on {self.gguf})")
            try:
                with urllib.request.urlopen(f"{self._url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        self._stop()
        raise PeerUnavailable(f"llama-server did not become healthy within {START_TIMEOUT_S:.0f} s")

    def _stop(self) -> None:
        if self._process is not None:
            _terminate(self._process)
            self._process = None

    # -- requests ----------------------------------------------------------------------------------

    def _post(self, prompt: list[int], output_len: int, stream: bool = False):
        body = {"prompt": prompt, "n_predict": output_len, "ignore_eos": True, "temperature": 0.0, "top_k": 1,
                "cache_prompt": False, "stream": stream}
        request = urllib.request.Request(f"{self._url}/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        return urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S)

    def _complete(self, request: BenchRequest) -> int:
        """Tokens the server generated for one request."""
        with self._post(request.prompt, request.output_len) as response:
            return json.loads(response.read())["tokens_predicted"]


class LlamaServerDraftSystem(LlamaServerSystem):
    """llama-server speculating with a draft model: the peer of kvgen's `--speculative-method draft`."""

    name = "llama-server-draft"

    def __init__(self, model: BenchModel, dtype: str, max_len: int, device: str, draft: Draft | None = None) -> None:
        if draft is None or draft.gguf.suffix != ".gguf" or not draft.gguf.is_file():
            raise PeerUnavailable(f"{self.name}: needs --draft-model, a GGUF file (got {draft and draft.gguf})")
        super().__init__(model, dtype, max_len, device)
        self.draft = draft

    def _server_args(self, slots: int, port: int) -> list[str]:
        return super()._server_args(slots, port) + ["--model-draft", str(self.draft.gguf), "--spec-type",
                                                    "draft-simple", "--spec-draft-n-max", str(self.draft.k)]

    def generate_timed(self, prompt: list[int], output_len: int) -> TokenTimes:
        """As llama-server's, failing where the server did not speculate (a flag it ignored)."""
        times = super().generate_timed(prompt, output_len)
        if not self.last_timings.get("draft_n"):
            raise RuntimeError(f"llama-server proposed no draft tokens (timings: {self.last_timings})")
        return times


def _terminate(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
