"""The decoder architectures kvgen runs: one small file each, found by this registry.

An architecture file (`llama.py`, `gemma3.py`, ...) defines `ARCHITECTURE`, an `Architecture`
(kvgen.architectures.spec): which blocks its layers are composed of, its norms and embedding, how its
Hugging Face and GGUF checkpoints name their tensors, and what its config and GGUF metadata add. This
package is pure description, below `kvgen.config` and the loaders, which read it; the model builds
runnable blocks from it (kvgen.model.blocks).

Adding an architecture is adding a file here: every module of this package that defines
`ARCHITECTURE` is registered at import; no other file changes (unless it needs a new kind of block:
a spec in `spec.py` and its code in kvgen.model.blocks).

    llama    Llama 2/3, Mistral, SmolLM, TinyLlama: pre-norm, SwiGLU
    qwen2    + q/k/v biases
    qwen3    + per-head RMSNorm of q and k (QK-norm), an explicit head_dim
    phi3     the Llama block, stored with fused qkv_proj and gate_up_proj
    gemma3   QK-norm, GeGLU, norms before and after attention and MLP, RMSNorm by (1 + w), scaled
             embeddings, sliding-window layers interleaved with global ones
    qwen35   three Gated DeltaNet layers (a recurrent state per sequence) to one of gated attention
"""

from __future__ import annotations

import importlib
import pkgutil

from kvgen.architectures.spec import Architecture


def _discover() -> dict[str, Architecture]:
    found = {}
    for module in pkgutil.iter_modules(__path__):
        arch = getattr(importlib.import_module(f"{__name__}.{module.name}"), "ARCHITECTURE", None)
        if isinstance(arch, Architecture):
            if arch.name in found:
                raise ValueError(f"architecture {arch.name!r} is defined twice")
            found[arch.name] = arch
    return dict(sorted(found.items()))


ARCHITECTURES = _discover()
BY_HF_MODEL_TYPE = {t: arch for arch in ARCHITECTURES.values() for t in arch.hf_model_types}
BY_GGUF_NAME = {arch.gguf_name: arch for arch in ARCHITECTURES.values()}


# Architectures whose checkpoints kvgen recognises but does not run yet (GGUF names and HF model
# types): why, in one line.
NOT_YET = dict.fromkeys(("qwen35moe", "qwen3_5_moe"),
                        "Qwen3.5 MoE runs from its text model's HF directory (model_type qwen3_5_moe_text) only: "
                        "its GGUF and multimodal checkpoints are not supported yet")


def known_names() -> str:
    """The architectures kvgen runs, for error messages."""
    return ", ".join(ARCHITECTURES)
