"""GGUF K-quant matrices (Q4_K, Q5_K, Q6_K) in a layout close to the file's, for kquant.c.

The generic format of kvgen.model.formats.packed widens a K-quant's per-super-block integers into
fp32 scales and mins per sub-block and Q5_K/Q6_K's codes to 8 bits: 6 / 10 / 10 bits a weight where
the file takes 4.5 / 5.5 / 6.56. Decode reads every weight once a token, so those bytes cost
directly. This layout keeps the file's integers (sc, m as bytes, d and dmin fp16 per 256 columns,
4-bit codes plus 1 or 2 high-bit planes): 4.625 / 5.625 / 6.625 bits a weight.

Rows go in panels of 16 (the last padded with zero rows), each panel stored super-block by
super-block as one stream; kquant.c's header gives the bytes of a block. kquant_pack.c packs it at
load, straight from the file's memory map (KQuantKernel.pack). `dequantize` reads the layout back
(the reference the kernel is tested against); its values equal gguf's dequantization bit for bit
(d*sc*q - dmin*m and d*sc*(q - 32) in fp32, as gguf computes them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType

from kvgen.model.formats.gguf_blocks import QK_K

Q = GGMLQuantizationType
PANEL = 16   # rows per panel
META = 320   # bytes of a block's scales (kquant.c)
LOW = 2048   # bytes of a block's low nibbles
HIGH = {Q.Q4_K: 0, Q.Q5_K: 512, Q.Q6_K: 1024}  # bytes of a block's high-bit planes
KINDS = {Q.Q4_K: "q4_k", Q.Q5_K: "q5_k", Q.Q6_K: "q6_k"}


@dataclass(frozen=True)
class KPacked:
    data: torch.Tensor         # uint8 [panels, blocks * block_bytes], panels = ceil(out / 16)
    ggml_type: Q
    shape: tuple[int, int]     # (out, in)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def kind(self) -> str:
        return KINDS[self.ggml_type]


def block_bytes(ggml_type: Q) -> int:
    return META + LOW + HIGH[ggml_type]


def dequantize(w: KPacked) -> torch.Tensor:
    """The fp32 weight [out, in] the layout stands for (read back from the packed bytes)."""
    return dequantize_rows(w, torch.arange(w.shape[0]))


def dequantize_rows(w: KPacked, rows: torch.Tensor) -> torch.Tensor:
    """dequantize(w)[rows] (rows int64 [n]) -> fp32 [n, in], reading only those rows' lanes of
    their panels: an embedding lookup in a table that stays packed (a tied LM head shares it)."""
    n, cols, nb = len(rows), w.shape[1], w.shape[1] // QK_K
    blocks = w.data[rows // PANEL].reshape(n, nb, block_bytes(w.ggml_type))
    lane = (torch.arange(n), rows % PANEL)

    def field(at: int, size: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """Bytes [at, at + size) of each block, entries of 16 lanes -> the row's entries [n, nb, k]."""
        values = blocks[..., at:at + size].contiguous().view(dtype)
        return values.reshape(n, nb, -1, PANEL).permute(0, 3, 1, 2)[lane]

    low = field(META, LOW, torch.int32).contiguous().view(torch.uint8).reshape(n, nb, 32, 4)  # [n, nb, s*v, b]
    q = torch.stack([low & 0x0F, low >> 4], dim=-2).reshape(n, nb, QK_K).to(torch.int32)
    if HIGH[w.ggml_type]:
        q = q | (_high_bits(field(META + LOW, HIGH[w.ggml_type], torch.int32), w.ggml_type) << 4)
    d = field(256, 32, torch.float16).float()                          # [n, nb, 1]
    if w.ggml_type == Q.Q6_K:
        sc = field(0, 256, torch.int8).float()                         # [n, nb, 16]
        values = (d * sc)[..., None] * (q - 32).float().reshape(n, nb, 16, 16)
        return values.reshape(n, cols)
    sc, m = field(0, 128).float(), field(128, 128).float()             # [n, nb, 8]
    dmin = field(288, 32, torch.float16).float()
    return ((d * sc)[..., None] * q.reshape(n, nb, 8, 32).float() - (dmin * m)[..., None]).reshape(n, cols)


def _high_bits(words: torch.Tensor, ggml_type: Q) -> torch.Tensor:
    """A row's high-bit words [n, nb, 8 or 16] -> bits 4.. of its codes as int32 [n, nb, 256]."""
    n, nb = words.shape[:2]
    if ggml_type == Q.Q5_K:  # word s: bit 8b+g for column 32s+4g+b
        shifts = 8 * torch.arange(4) + torch.arange(8)[:, None]           # [g, b]
        return ((words[..., None, None] >> shifts) & 1).reshape(n, nb, QK_K)
    shifts = 8 * torch.arange(4) + 2 * torch.arange(4)[:, None]            # [j, b]; word 2s+k: column 32s+4(4k+j)+b
    return ((words[..., None, None] >> shifts) & 3).reshape(n, nb, QK_K)
