"""The q/k row layouts of rotary embeddings: llama2.c and llama.cpp's `llama` GGUFs store each head's
rows as interleaved (real, imaginary) pairs, Hugging Face as two halves."""

from __future__ import annotations

import torch


def interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorders q/k projection rows from interleaved-pair RoPE to HF's rotate-half layout.

    Within each head, rows (0,1),(2,3),... are the (real, imaginary) pairs in llama2.c and GGUF; HF wants
    all first halves, then all second halves: [x0, x1, x2, x3] -> [x0, x2, x1, x3]. This is the inverse of
    llama.cpp's `permute` in convert_hf_to_gguf.py and the `permute` in HF's convert_llama_weights_to_hf.py.
    """
    # w: [n_heads * head_dim, ...] -> [n_heads, head_dim/2, 2, ...] -> [n_heads, 2, head_dim/2, ...]
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
