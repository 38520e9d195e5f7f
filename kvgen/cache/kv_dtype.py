"""The KV pools' default dtype: what `kv_cache_dtype="auto"` becomes for a loaded model.

    weights kept packed (a GGUF's quantized matrices,        bfloat16: half fp32's bytes a token (the
    or float ones packed by --quantization int8 / int4)      K/V of a 1.5B: 57 -> 28 KB), the range
                                                             of fp32 (no overflow on any model)
    a half-precision model (--dtype bfloat16 / float16)      the model's dtype
    an fp32 model (HF fp32 directories, --quantization      float32: the parity setting, where outputs
    none, llama2.c checkpoints, a GGUF of float tensors)     match transformers token for token

An explicit `kv_cache_dtype` is kept; so is "auto" off the paged cache (the contiguous and no-cache
engines hold K/V in the model's dtype) and on CUDA (the GPU runs its own kernels over the model's dtype).
The paged decode kernel (kvgen/model/kernels/paged_decode.c) reads bf16 and fp16 pools alike (a
16-bit shift, or one vcvtph2ps, per 16 values); bf16 is chosen for its range.
"""

from __future__ import annotations

import dataclasses

import torch

from kvgen.config import DTYPES, EngineConfig
from kvgen.loaders import LoadedModel

PACKED_KV_DTYPE = "bfloat16"


def default_kv_dtype(loaded: LoadedModel, config: EngineConfig) -> str:
    """The pools' dtype by name for `kv_cache_dtype="auto"` (see the module's table)."""
    model_dtype = DTYPES[config.dtype]
    if config.kv_cache != "paged" or torch.device(config.device).type != "cpu" or model_dtype != "float32":
        return model_dtype
    packed = bool(loaded.quantized) or config.quantization in ("int8", "int4")
    return PACKED_KV_DTYPE if packed else model_dtype


def resolve_kv_dtype(loaded: LoadedModel, config: EngineConfig) -> EngineConfig:
    """`config` with "auto" replaced by `default_kv_dtype` (paged cache only); unchanged otherwise."""
    if config.kv_cache_dtype != "auto" or config.kv_cache != "paged":
        return config
    return dataclasses.replace(config, kv_cache_dtype=default_kv_dtype(loaded, config))
