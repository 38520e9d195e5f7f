"""The peers benchmarked beside kvgen's engine on the same weights (kvgen.bench.system says what every
system does; kvgen's own is kvgen.bench.system.KvgenSystem).

Peers import lazily: a missing package becomes `PeerUnavailable` with the pip command to fix it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from benchmarks.llama_server import Draft, LlamaServerDraftSystem, LlamaServerSystem
from benchmarks.models import BenchModel, converted, gguf_for, load_hf_model, plain_hf_dir
from kvgen.bench.latency import gguf_matmul_bytes
from kvgen.bench.system import BenchRequest, PeerUnavailable, System, TokenTimes


def load_peer(name: str, model: BenchModel, dtype: str, max_len: int, device: str = "cpu",
              draft: Draft | None = None) -> System:
    """The named peer on `model` in `dtype` ("float32", "float16", "bfloat16") on `device`, able to hold
    `max_len` tokens (`draft`: kvgen's draft model and K, for the peer that speculates with them).
    Raises PeerUnavailable when it is not installed or cannot read the model."""
    system, module, pip_name = _PEERS[name]
    if device != "cpu" and not issubclass(system, HFSystem):
        raise PeerUnavailable(f"{name}: runs on the CPU only in kvgen bench (not {device})")
    try:
        if system is LlamaServerDraftSystem:
            return system(model, dtype, max_len, device, draft)
        return system(model, dtype, max_len, device)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != module:
            raise
        raise PeerUnavailable(f"{name}: not installed (pip install {pip_name})") from None
    except (ValueError, OSError, RuntimeError) as e:
        raise PeerUnavailable(f"{name}: cannot load {model.path}: {e}") from None


# -- Hugging Face transformers --------------------------------------------------------------------


class HFSystem(System):
    """transformers `generate` on the same files (GGUF via gguf_file=), default dynamic KV cache."""

    name = "hf"

    def __init__(self, model: BenchModel, dtype: str, max_len: int, device: str) -> None:
        self.device = torch.device(device)
        self.model = load_hf_model(model, getattr(torch, dtype)).to(self.device)

    @torch.inference_mode()
    def generate_timed(self, prompt: list[int], output_len: int) -> TokenTimes:
        streamer = _TimingStreamer()
        start = time.monotonic()
        self._generate(torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.long), output_len, streamer)
        return TokenTimes(start, streamer.times)

    @torch.inference_mode()
    def run_batch(self, requests: Sequence[BenchRequest]) -> None:
        """One static batch: prompts left-padded to the longest, every row decoded to the longest output."""
        width = max(len(r.prompt) for r in requests)
        ids = torch.zeros(len(requests), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(requests):
            ids[row, width - len(r.prompt):] = torch.tensor(r.prompt)
            mask[row, width - len(r.prompt):] = 1
        self._generate(ids, mask, max(r.output_len for r in requests))

    def _generate(self, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, streamer=None) -> None:
        self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                            max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                            streamer=streamer)


class HFStaticSystem(HFSystem):
    """generate() with its static KV cache; on a GPU transformers compiles the decode forward itself
    (torch.compile, CompileConfig's reduce-overhead), plain PyTorch's fastest batch-1 decode."""

    name = "hf-static"

    def _generate(self, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, streamer=None) -> None:
        self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                            max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                            streamer=streamer, cache_implementation="static")


class HFContinuousSystem(HFSystem):
    """transformers' continuous batching (kvgen.bench.gpu_peers), each request with its own length."""

    name = "hf-cb"

    @torch.inference_mode()
    def run_batch(self, requests: Sequence[BenchRequest]) -> None:
        from kvgen.bench.gpu_peers import run_continuous

        generated = run_continuous(self.model, [r.prompt for r in requests], [r.output_len for r in requests])
        if generated != sum(r.output_len for r in requests):
            raise RuntimeError(f"transformers continuous batching gave {generated} tokens, "
                               f"not {sum(r.output_len for r in requests)}")

    def run_at(self, requests: Sequence[BenchRequest], size: int) -> None:
        self.run_batch(requests)  # the manager batches by itself: one size


class _TimingStreamer:
    """A transformers streamer (batch 1) that records when each token arrives; the first put is the prompt."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:  # transformers puts tokens already copied to the CPU: the step is done
            self.times.extend([time.monotonic()] * value.numel())  # several at once when speculating
        self._prompt_seen = True

    def end(self) -> None:
        pass


# -- llama.cpp ------------------------------------------------------------------------------------


class LlamaCppSystem(System):
    """llama-cpp-python on a GGUF of the same weights. Its Python API generates one sequence at a time.

    In this process ggml's OpenMP threads are torch's libgomp, so they run under kvgen's settings
    (kvgen/threads.py: workers spin ~0.3 ms, then sleep); with llama.cpp's own defaults, llama-bench
    decodes the Q4_1 file ~4% faster here (BENCHMARKS.md)."""

    name = "llama.cpp"
    batched = False

    def __init__(self, model: BenchModel, dtype: str, max_len: int, device: str) -> None:
        from llama_cpp import Llama

        threads = torch.get_num_threads()
        self.gguf = gguf_for(model, dtype)
        self.llm = Llama(model_path=str(self.gguf), n_ctx=max_len, n_batch=512, n_threads=threads,
                         n_threads_batch=threads, verbose=False)

    def weight_bytes(self) -> int:
        return gguf_matmul_bytes(self.gguf)

    def build_note(self) -> str:
        from llama_cpp import llama_print_system_info

        return llama_cpp_build_note(llama_print_system_info().decode())

    def generate_timed(self, prompt: list[int], output_len: int) -> TokenTimes:
        self.llm.reset()
        times: list[float] = []
        start = time.monotonic()
        for _ in self.llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            times.append(time.monotonic())
            if len(times) == output_len:
                break
        return TokenTimes(start, times)

    def run_batch(self, requests: Sequence[BenchRequest]) -> None:
        for r in requests:
            self.generate_timed(r.prompt, r.output_len)


def llama_cpp_build_note(system_info: str) -> str:
    """llama.cpp's system info ("CPU : SSE3 = 1 | ... | AVX512 = 1 | ...") -> the features it was
    built with, and whether AMX is among them: a build for CPUs that advertise AMX but trap on it
    must leave it out (BENCHMARKS.md has the flags)."""
    features = [part.split("=")[0].split(":")[-1].strip() for part in system_info.split("|") if part.strip().endswith("= 1")]
    amx = [f for f in features if f.startswith("AMX")]
    return f"llama.cpp built with {', '.join(features)}" + ("" if amx else " (no AMX)")


# -- CTranslate2 ----------------------------------------------------------------------------------


class CTranslate2System(System):
    """CTranslate2's Generator on a conversion of the same HF weights (TransformersConverter).

    Its generate_batch(max_batch_size=) sorts prompts by length before cutting batches, so that a
    batch's shorter prompts wait on few forced steps (see _generate); kvgen bench does the same.
    """

    name = "ct2"
    sorts_by_length = True

    def __init__(self, model: BenchModel, dtype: str, max_len: int, device: str) -> None:
        import ctranslate2

        directory = _ct2_model(model, dtype)
        self.generator = ctranslate2.Generator(str(directory), device="cpu", compute_type=dtype,
                                               intra_threads=torch.get_num_threads())
        self.vocab = _ct2_vocabulary(directory)

    def generate_timed(self, prompt: list[int], output_len: int) -> TokenTimes:
        times: list[float] = []

        def on_token(_step) -> bool:
            times.append(time.monotonic())
            return False

        start = time.monotonic()
        self._generate([prompt], output_len, callback=on_token)
        return TokenTimes(start, times)

    def run_batch(self, requests: Sequence[BenchRequest]) -> None:
        self._generate([r.prompt for r in requests], max(r.output_len for r in requests))

    def _generate(self, prompts: list[list[int]], new_tokens: int, **kwargs) -> None:
        """Greedy, at least `new_tokens` per prompt. CTranslate2 forwards the prompts up to the shortest
        at once and steps the rest of the longer ones through its decoding loop, where they count
        against max_length: hence the allowance for the spread of prompt lengths."""
        spread = max(map(len, prompts)) - min(map(len, prompts))
        results = self.generator.generate_batch(
            [[self.vocab[t] for t in p] for p in prompts], max_length=new_tokens + spread,
            min_length=new_tokens + spread, include_prompt_in_result=False, sampling_topk=1, **kwargs)
        made = min(len(r.sequences_ids[0]) for r in results)
        if made < new_tokens:
            raise RuntimeError(f"CTranslate2 generated {made} tokens where {new_tokens} were asked for")


def _ct2_model(model: BenchModel, dtype: str) -> Path:
    from ctranslate2.converters import TransformersConverter

    hf_dir = plain_hf_dir(model)
    return converted(BenchModel(model.name, hf_dir), f"ct2-{dtype}",
                     lambda tmp: TransformersConverter(str(hf_dir)).convert(str(tmp), quantization=dtype, force=True))


def _ct2_vocabulary(directory: Path) -> list[str]:
    if (directory / "vocabulary.json").is_file():
        return json.loads((directory / "vocabulary.json").read_text())
    return (directory / "vocabulary.txt").read_text().splitlines()


# -- prompt lookup decoding in the peers (compared with kvgen --speculative-method ngram) -----------

PEER_LOOKUP_TOKENS = 10  # tokens proposed per step: the default of both HF and llama-cpp-python


class HFLookupSystem(HFSystem):
    """transformers `generate(prompt_lookup_num_tokens=...)`: HF's prompt lookup decoding (batch 1 only)."""

    name = "hf-lookup"
    batched = False

    def run_batch(self, requests: Sequence[BenchRequest]) -> None:
        for r in requests:
            self.generate_timed(r.prompt, r.output_len)

    def _generate(self, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, streamer=None) -> None:
        self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                            max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                            streamer=streamer, prompt_lookup_num_tokens=PEER_LOOKUP_TOKENS)


class LlamaCppLookupSystem(LlamaCppSystem):
    """llama-cpp-python with `LlamaPromptLookupDecoding` as its draft model (its defaults: bigrams)."""

    name = "llama.cpp-lookup"

    def __init__(self, model: BenchModel, dtype: str, max_len: int, device: str) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        threads = torch.get_num_threads()
        self.gguf = gguf_for(model, dtype)
        self.llm = Llama(model_path=str(self.gguf), n_ctx=max_len, n_batch=512, n_threads=threads,
                         n_threads_batch=threads, verbose=False,
                         draft_model=LlamaPromptLookupDecoding(num_pred_tokens=PEER_LOOKUP_TOKENS))


# name -> (system, the module it needs, the pip package that provides it)
_PEERS: dict[str, tuple[Callable[[BenchModel, str, int, str], System], str, str]] = {
    "hf": (HFSystem, "transformers", "transformers"),
    "llama.cpp": (LlamaCppSystem, "llama_cpp", "llama-cpp-python"),
    "llama-server": (LlamaServerSystem, "kvgen", "llama.cpp's llama-server"),
    "llama-server-draft": (LlamaServerDraftSystem, "kvgen", "llama.cpp's llama-server"),
    "ct2": (CTranslate2System, "ctranslate2", "ctranslate2"),
    "hf-lookup": (HFLookupSystem, "transformers", "transformers"),
    "llama.cpp-lookup": (LlamaCppLookupSystem, "llama_cpp", "llama-cpp-python"),
}

_PEERS["hf-static"] = (HFStaticSystem, "transformers", "transformers")
_PEERS["hf-cb"] = (HFContinuousSystem, "transformers", "transformers")
PEERS = tuple(_PEERS)
