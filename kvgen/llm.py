"""The Python API: `LLM(model).generate(prompts, params)`.

    from kvgen import LLM, SamplingParams
    llm = LLM()                                   # the default model (stories260K)
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=64))
    print(out[0].text)
"""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from kvgen.cache.kv_dtype import resolve_kv_dtype
from kvgen.cache.sizing import format_bytes
from kvgen.config import DTYPES, EngineConfig
from kvgen.engine.base import Engine, Prompt
from kvgen.engine.llm_engine import LLMEngine
from kvgen.engine.recurrent import recurrent_refusal
from kvgen.engine.sequential import SequentialEngine
from kvgen.loaders import LoadedModel, load_model
from kvgen.loaders.hub import resolve_model
from kvgen.loaders.progress import loading
from kvgen.loaders.residency import keep_step_buffers, peak_rss_bytes, rss_bytes, trim_heap
from kvgen.sampling_params import SamplingParams
from kvgen.scheduling.sequence import RequestOutput

# stories260K ships inside the package (MIT licence; see its README), so the default works anywhere.
DEFAULT_MODEL = Path(__file__).resolve().parent / "models" / "stories260K" / "stories260K.bin"


def default_model_path() -> Path:
    """`KVGEN_MODEL` if set, else the packaged stories260K."""
    return Path(os.environ["KVGEN_MODEL"]) if os.environ.get("KVGEN_MODEL") else DEFAULT_MODEL


def build_engine(loaded: LoadedModel, config: EngineConfig) -> Engine:
    """The paged continuous-batching engine, or the one-at-a-time reference for contiguous / none;
    across processes with tensor_parallel_size > 1 (a torchrun worker rank serves its part of every
    step inside this call and exits the process when rank 0 stops). A draft model for speculative
    decoding is loaded here, its quantization being config.draft_weights."""
    config = resolve_kv_dtype(loaded, config)  # every rank of a tensor-parallel group alike
    refusal = recurrent_refusal(loaded.config, config)
    if refusal is not None:
        raise ValueError(refusal)
    if config.tensor_parallel_size > 1:
        from kvgen.distributed.launch import build_tensor_parallel_engine

        return build_tensor_parallel_engine(loaded, config)
    if config.kv_cache != "paged":
        return SequentialEngine(loaded, config)
    draft = None
    if config.speculative_method == "draft":
        draft = load(config.draft_model, dataclasses.replace(config, quantization=config.draft_weights))
    return LLMEngine(loaded, config, draft)


def load(model: str | Path | None, config: EngineConfig, tokenizer: str | Path | None = None,
         gguf_file: str | None = None) -> LoadedModel:
    """The model at a path or Hugging Face repo id (`org/name`, `org/name:Q4_K_M`, or `gguf_file` in it).

    The one place `config.quantization` meets the loader: 'auto' keeps a GGUF's block-quantized
    matrices raw (`LoadedModel.quantized`) for the model's quantized layers, and so do 'int8' /
    'int4', for which the model packs again those it makes smaller, one at a time (a float
    checkpoint's floats are packed alike); 'none' dequantizes them.
    """
    path = resolve_model(str(model), gguf_file) if model is not None else default_model_path()
    # On CUDA a GGUF's matrices are dequantized at load, one tensor at a time, straight to the
    # model's dtype on the device (docs/gpu.md): its matmuls are torch's, which read floats.
    on_gpu = torch.device(config.device).type == "cuda"
    reload = partial(load_model, path, tokenizer_path=tokenizer, device=config.device,
                     dtype=getattr(torch, DTYPES[config.dtype]) if on_gpu else torch.float32,
                     keep_quantized=config.quantization != "none" and not on_gpu)
    if config.tensor_parallel_size == 1:
        return reload()
    from kvgen.distributed.launch import local_rank_of

    loaded = reload(shard=(local_rank_of(config), config.tensor_parallel_size))
    loaded.reload = reload
    return loaded


@dataclasses.dataclass(frozen=True)
class LoadStats:
    """How loading went: wall time from the first byte read to a ready engine, the model file's size
    (None for a directory), and this process's RSS after loading and at its peak."""

    seconds: float
    source: str
    file_bytes: int | None
    rss_bytes: int | None
    peak_rss_bytes: int

    def summary(self) -> str:
        file = f" ({format_bytes(self.file_bytes)})" if self.file_bytes else ""
        rss = format_bytes(self.rss_bytes) if self.rss_bytes is not None else "unknown"
        return (f"loaded {self.source}{file} in {self.seconds:.2f} s; RSS {rss}, "
                f"peak {format_bytes(self.peak_rss_bytes)}")


def open_engine(model: str | Path | None, config: EngineConfig, tokenizer: str | Path | None = None,
                gguf_file: str | None = None) -> tuple[Engine, LoadStats]:
    """`build_engine(load(...))` with a progress bar while the weights are converted (on a terminal,
    kvgen.loaders.progress), the heap that conversion freed handed back and the steps' freed buffers
    kept for the next step (kvgen.loaders.residency), and how long it took and what stays resident."""
    started = time.perf_counter()
    loaded = load(model, config, tokenizer, gguf_file)
    total = sum(w.raw.nbytes for w in loaded.quantized.values()) + sum(t.nbytes for t in loaded.weights.values())
    with loading(total):
        engine = build_engine(loaded, config)
    source = loaded.source
    del loaded  # the memory map of a GGUF goes with the last view of its bytes
    trim_heap()
    keep_step_buffers()
    size = os.path.getsize(source) if os.path.isfile(source) else None
    return engine, LoadStats(time.perf_counter() - started, source, size, rss_bytes(), peak_rss_bytes())


class LLM:
    """Offline generation over the engine. Engine options are keyword arguments (see EngineConfig)."""

    def __init__(self, model: str | Path | None = None, *, tokenizer: str | Path | None = None,
                 gguf_file: str | None = None, **engine_options) -> None:
        self.config = EngineConfig(**engine_options)
        self.engine, self.load_stats = open_engine(model, self.config, tokenizer, gguf_file)
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Stops the engine's tensor-parallel workers, if any (also done at exit)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Runs every prompt through the engine; outputs come back in prompt order."""
        prompt_list = _as_prompt_list(prompts)
        param_list = _as_param_list(params, len(prompt_list))
        ids = [f"gen-{uuid.uuid4().hex}" for _ in prompt_list]
        try:
            for request_id, prompt, p in zip(ids, prompt_list, param_list):
                self.engine.add_request(request_id, prompt, p)
        except BaseException:
            for request_id in ids:  # a bad prompt must not leave the good ones before it queued
                self.engine.abort(request_id)
            raise
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="requests", unit="req", disable=not use_tqdm) as bar:
            generated = 0
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    generated += sum(len(c.new_token_ids) for c in out.outputs)
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
                bar.set_postfix(tok_s=f"{generated / max(bar.format_dict['elapsed'], 1e-9):.1f}")
        return [finished[i] for i in ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _as_param_list(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
    return params
