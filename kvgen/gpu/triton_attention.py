"""Triton kernels over kvgen's paged KV pools (layout: kvgen.model.attention.PagedKVCache).

    pool        [kv_heads, num_slots, D] per layer, slot = block * block_size + offset
    scales      quantized pools only: keys [kv_heads, num_slots, D / 16] (or [kv_heads, num_slots]),
                values [kv_heads, num_slots]; a value is `stored * scale` (kvgen.model.kv_quant)
    block_table [B, N] block ids of each sequence's keys, in order (column j of the sequence's keys
                lives in block block_table[b, j // block_size] at offset j % block_size)
    lo, hi      [B * Q] per query row: it attends to key columns [lo, hi) of its sequence

The [lo, hi) ranges carry causality, the per-layer sliding window and a ragged batch at once: the
runner's masks (causal, within a window) are one run of keys per query, and `key_ranges` turns a
mask into them (masks that are not one run, attention sinks, go back to the torch path).

Three kernels:

- `store_kv`: a step's K/V rows into the pools at their slots, rounded to the pool's float dtype to
  nearest even (bf16 by explicit bit arithmetic, so that Triton's interpreter, which truncates a
  bf16 cast, gives torch's bits too). Quantized pools are written by torch (PagedKVCache.write).
- `paged_decode` (flash-decoding): one program per (query row, KV head, key split) holds the query
  heads of that KV head (GQA: each K/V tile loaded once for the group; `tl.dot` when the group pads
  to 16+ rows, a broadcast product below) and runs an online softmax over its split's share of the
  row's key range in tiles of BLOCK_N keys, reading K/V in place through the block table; int8 /
  fp8 pools are scaled on load. Each split leaves its max, sum and unnormalized output, and
  `_decode_reduce_kernel` joins them by the log-sum-exp rule. `decode_splits` picks the split count
  from things static in a CUDA graph (rows, KV heads, the block table's width); with one split the
  kernel writes the output itself and no reduce runs (large batches: the old one-program-a-row
  kernel, exactly).
- `paged_prefill`: one program per (tile of BLOCK_M query rows of one sequence, query head), the
  same online softmax with `tl.dot` over [BLOCK_M, BLOCK_N] tiles (a prompt chunk, or a ragged
  batch of verify chunks).

Scores, softmax and the accumulator are fp32 whatever the pools hold. The attention scale is
1/sqrt(D): kvgen folds any other scale into q (kvgen.model.blocks.attention), and no supported model soft-caps
attention logits (Gemma 2's option; kvgen.config refuses it).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _store_kv_kernel(x_ptr, pool_ptr, slot_ptr, stride_xt, stride_xh, stride_ph, stride_ps,
                     D: tl.constexpr, D_P: tl.constexpr, BF16_BITS: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, D_P)
    dmask = d < D
    slot = tl.load(slot_ptr + t).to(tl.int64)
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + d, mask=dmask, other=0.0)
    dst = pool_ptr + h * stride_ph + slot * stride_ps + d
    if BF16_BITS:
        # fp32 -> bf16 to nearest even on the bits; the pool is passed as int16
        u = x.to(tl.float32).to(tl.uint32, bitcast=True)
        u = u + 0x7FFF + ((u >> 16) & 1)
        tl.store(dst, (u >> 16).to(tl.uint16).to(tl.int16, bitcast=True), mask=dmask)
    else:
        tl.store(dst, x.to(pool_ptr.dtype.element_ty), mask=dmask)


def store_kv(pool: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """x [T, kv_heads, D] into the float pool [kv_heads, num_slots, D] at slots [T]."""
    tokens, kv_heads, head_dim = x.shape
    if tokens == 0:
        return
    if x.stride(-1) != 1:
        x = x.contiguous()
    bf16_bits = pool.dtype == torch.bfloat16 and x.dtype != torch.bfloat16
    target = pool.view(torch.int16) if bf16_bits else pool
    _store_kv_kernel[(tokens, kv_heads)](
        x, target, slots, x.stride(0), x.stride(1), pool.stride(0), pool.stride(1),
        D=head_dim, D_P=triton.next_power_of_2(head_dim), BF16_BITS=bf16_bits)


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, lo_ptr, hi_ptr, o_ptr, pm_ptr, pl_ptr, pacc_ptr,
                   stride_qr, stride_qh, stride_ph, stride_ps, stride_bt,
                   stride_ksh, stride_kss, stride_vsh, stride_vss, stride_or, stride_oh,
                   rows_per_seq, qk_scale, splits,
                   BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
                   D: tl.constexpr, D_P: tl.constexpr, BLOCK_N: tl.constexpr,
                   QUANT: tl.constexpr, KEY_GROUP: tl.constexpr, DIRECT: tl.constexpr,
                   DOT: tl.constexpr, IEEE: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = row // rows_per_seq
    lo = tl.load(lo_ptr + row)
    hi = tl.load(hi_ptr + row)
    # this split's share of [lo, hi): whole tiles of BLOCK_N keys, splits past the end are empty
    chunk = tl.cdiv(tl.cdiv(hi - lo, splits), BLOCK_N) * BLOCK_N
    s_lo = lo + split * chunk
    s_hi = tl.minimum(s_lo + chunk, hi)
    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, D_P)
    gmask = g < GROUP
    dmask = d < D
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + row * stride_qr + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    if DOT:
        if IEEE:
            q = q.to(tl.float32) * qk_scale
        else:
            q = (q.to(tl.float32) * qk_scale).to(q.dtype)
    else:
        q = q.to(tl.float32) * qk_scale
    m = tl.full([GROUP_P], -1.0e30, tl.float32)
    total = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, D_P], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for start in range(s_lo, s_hi, BLOCK_N):
        cols = start + n
        valid = cols < s_hi
        block = tl.load(bt_ptr + seq * stride_bt + cols // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        slots = block * BLOCK_SIZE + cols % BLOCK_SIZE
        kv_mask = valid[:, None] & dmask[None, :]
        offs = kv_head * stride_ph + slots[:, None] * stride_ps + d[None, :]
        k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)
        if QUANT:
            ks = tl.load(ks_ptr + kv_head * stride_ksh + slots[:, None] * stride_kss + (d // KEY_GROUP)[None, :],
                         mask=kv_mask & (d < (D // KEY_GROUP) * KEY_GROUP)[None, :], other=0.0)
            k = k * ks
            v = v * tl.load(vs_ptr + kv_head * stride_vsh + slots * stride_vss, mask=valid, other=0.0)[:, None]
        if DOT:
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k.to(q.dtype)))
        else:
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP_P, BLOCK_N], log2 units
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        if DOT:
            if IEEE:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        else:
            pv = tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        m = m_new
    omask = gmask[:, None] & dmask[None, :]
    if DIRECT:
        out = acc / tl.maximum(total, 1.0e-30)[:, None]
        tl.store(o_ptr + row * stride_or + heads[:, None] * stride_oh + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=omask)
    else:
        # partials [rows, heads, splits] (max, sum) and [rows, heads, splits, D_P] (unnormalized output)
        # the reduce reads only the splits that held keys, and split 0 always: the rest store nothing
        # (the mask a vector: the interpreter refuses a scalar bool in it)
        part = (row * (GROUP * tl.num_programs(1)) + heads) * splits + split
        keep = gmask & ((g * 0 + s_lo < s_hi) | (g * 0 + split == 0))
        tl.store(pm_ptr + part, m, mask=keep)
        tl.store(pl_ptr + part, total, mask=keep)
        tl.store(pacc_ptr + part[:, None] * D_P + d[None, :], acc, mask=keep[:, None] & dmask[None, :])


@triton.jit
def _decode_reduce_kernel(pm_ptr, pl_ptr, pacc_ptr, lo_ptr, hi_ptr, o_ptr, stride_or, stride_oh, heads, splits,
                          D: tl.constexpr, D_P: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_TILE: tl.constexpr):
    """One program per (row, head): the splits' partials joined by the log-sum-exp rule, in tiles of
    SPLIT_TILE splits (an online max over the tiles). It reads only the splits that held keys (the
    first ones: the split kernel's same cut of [lo, hi)), so a graph's upper-bound split count costs
    the reduce nothing on short rows."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    keys = tl.load(hi_ptr + row) - tl.load(lo_ptr + row)
    chunk = tl.cdiv(tl.cdiv(keys, splits), BLOCK_N) * BLOCK_N
    used = tl.maximum(tl.cdiv(keys, tl.maximum(chunk, 1)), 1)
    d = tl.arange(0, D_P)
    t = tl.arange(0, SPLIT_TILE)
    base = (row * heads + head) * splits
    m = tl.full([1], -1.0e30, tl.float32)
    total = tl.zeros([1], tl.float32)
    acc = tl.zeros([D_P], tl.float32)
    for first in range(0, used, SPLIT_TILE):
        idx = first + t
        valid = idx < used
        pm = tl.load(pm_ptr + base + idx, mask=valid, other=-1.0e30)
        pl = tl.load(pl_ptr + base + idx, mask=valid, other=0.0)
        pacc = tl.load(pacc_ptr + (base + idx)[:, None] * D_P + d[None, :], mask=valid[:, None], other=0.0)
        m_new = tl.maximum(m, tl.max(pm, axis=0))
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(pm - m_new)  # empty splits: m = -1e30, sum 0, output 0
        total = total * alpha + tl.sum(w * pl, axis=0)
        acc = acc * alpha + tl.sum(w[:, None] * pacc, axis=0)
        m = m_new
    out = acc / tl.maximum(total, 1.0e-30)
    tl.store(o_ptr + row * stride_or + head * stride_oh + d, out.to(o_ptr.dtype.element_ty), mask=d < D)


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, lo_ptr, hi_ptr, o_ptr,
                    stride_qr, stride_qh, stride_ph, stride_ps, stride_bt,
                    stride_ksh, stride_kss, stride_vsh, stride_vss, stride_or, stride_oh,
                    rows_per_seq, tiles_per_seq, qk_scale,
                    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QUANT: tl.constexpr,
                    KEY_GROUP: tl.constexpr, IEEE: tl.constexpr):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    seq = tile // tiles_per_seq
    r = (tile % tiles_per_seq) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = r < rows_per_seq
    rows = seq * rows_per_seq + r
    lo = tl.load(lo_ptr + rows, mask=rmask, other=0)
    hi = tl.load(hi_ptr + rows, mask=rmask, other=0)
    d = tl.arange(0, D_P)
    dmask = d < D
    q = tl.load(q_ptr + rows[:, None] * stride_qr + head * stride_qh + d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    if IEEE:
        q = q.to(tl.float32) * qk_scale
    else:
        q = (q.to(tl.float32) * qk_scale).to(q.dtype)
    m = tl.full([BLOCK_M], -1.0e30, tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_P], tl.float32)
    n = tl.arange(0, BLOCK_N)
    first = tl.min(tl.where(rmask, lo, 1 << 30), axis=0)
    last = tl.max(hi, axis=0)
    for start in range(first, last, BLOCK_N):
        cols = start + n
        valid = cols < last
        block = tl.load(bt_ptr + seq * stride_bt + cols // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        slots = block * BLOCK_SIZE + cols % BLOCK_SIZE
        kv_mask = valid[:, None] & dmask[None, :]
        offs = kv_head * stride_ph + slots[:, None] * stride_ps + d[None, :]
        k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0)
        if QUANT:
            ks = tl.load(ks_ptr + kv_head * stride_ksh + slots[:, None] * stride_kss + (d // KEY_GROUP)[None, :],
                         mask=kv_mask & (d < (D // KEY_GROUP) * KEY_GROUP)[None, :], other=0.0)
            k = (k.to(tl.float32) * ks).to(q.dtype)
            vs = tl.load(vs_ptr + kv_head * stride_vsh + slots * stride_vss, mask=valid, other=0.0)
            v = (v.to(tl.float32) * vs[:, None]).to(q.dtype)
        else:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        allowed = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        if IEEE:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new
    out = acc / tl.maximum(total, 1.0e-30)[:, None]
    tl.store(o_ptr + rows[:, None] * stride_or + head * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


def _scales(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, head_dim: int, dummy: torch.Tensor):
    """(k_scale, v_scale, their strides, quantized?, dimensions per key scale)."""
    if k_scale is None:
        return dummy, dummy, (0, 0, 0, 0), False, head_dim
    key_group = head_dim // k_scale.shape[2] if k_scale.dim() == 3 else head_dim
    return (k_scale, v_scale, (k_scale.stride(0), k_scale.stride(1), v_scale.stride(0), v_scale.stride(1)),
            True, key_group)


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
                    lo: torch.Tensor, hi: torch.Tensor, block_size: int, rows_per_seq: int,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    out: torch.Tensor | None = None, prefill: bool | None = None,
                    splits: int | None = None) -> torch.Tensor:
    """q [B * Q, heads, D] (row r belongs to sequence r // Q, Q = rows_per_seq) attends to key
    columns [lo[r], hi[r]) of its sequence's blocks -> [B * Q, heads, D] in q's dtype.

    Decode rows (Q = 1) and small verify chunks take the decode kernel; prompt chunks (or
    `prefill=True`) the prefill kernel. `splits` (decode only) overrides `decode_splits`' choice."""
    rows, heads, head_dim = q.shape
    kv_heads = k_pool.shape[0]
    group = heads // kv_heads
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    if rows == 0:
        return out
    d_p = max(16, triton.next_power_of_2(head_dim))
    ks, vs, s_strides, quant, key_group = _scales(k_scale, v_scale, head_dim, lo)
    common = (q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), block_table.stride(0),
              *s_strides, out.stride(0), out.stride(1))
    use_prefill = rows_per_seq > 16 if prefill is None else prefill
    if not use_prefill:
        group_p = triton.next_power_of_2(group)
        block_n = _decode_block_n(group_p, d_p)
        if splits is None:
            splits = decode_splits(rows, kv_heads, block_table.shape[1] * block_size, block_n, q.device)
        direct = splits == 1
        if direct:
            pm = pl = pacc = out  # unused
        else:
            pm = torch.empty(rows * heads * splits, dtype=torch.float32, device=q.device)
            pl = torch.empty_like(pm)
            pacc = torch.empty(rows * heads * splits * d_p, dtype=torch.float32, device=q.device)
        _decode_kernel[(rows, kv_heads, splits)](
            q, k_pool, v_pool, ks, vs, block_table, lo, hi, out, pm, pl, pacc, *common, rows_per_seq,
            head_dim ** -0.5 * LOG2E, splits,
            BLOCK_SIZE=block_size, GROUP=group, GROUP_P=group_p, D=head_dim, D_P=d_p,
            BLOCK_N=block_n, QUANT=quant, KEY_GROUP=key_group, DIRECT=direct, DOT=group_p >= 16,
            IEEE=q.dtype == torch.float32 or _interpreted())
        if not direct:
            _decode_reduce_kernel[(rows, heads)](pm, pl, pacc, lo, hi, out, out.stride(0), out.stride(1), heads,
                                                 splits, D=head_dim, D_P=d_p, BLOCK_N=block_n, SPLIT_TILE=16)
        return out
    block_m = 32 if head_dim <= 128 else 16
    tiles_per_seq = triton.cdiv(rows_per_seq, block_m)
    _prefill_kernel[((rows // rows_per_seq) * tiles_per_seq, heads)](
        q, k_pool, v_pool, ks, vs, block_table, lo, hi, out, *common, rows_per_seq, tiles_per_seq,
        head_dim ** -0.5 * LOG2E,
        BLOCK_SIZE=block_size, GROUP=group, D=head_dim, D_P=d_p, BLOCK_M=block_m, BLOCK_N=32,
        QUANT=quant, KEY_GROUP=key_group, IEEE=q.dtype == torch.float32 or _interpreted())
    return out


def _decode_block_n(group_p: int, d_p: int) -> int:
    """Keys a decode tile holds: the [group, keys, D] product stays near 8K fp32 values a program
    (about 64 registers a thread at 4 warps), 16 to 64 keys."""
    return max(16, min(64, 8192 // (group_p * d_p)))


DECODE_WAVES = 2  # decode programs aimed at per SM (several small programs fit on one SM)
_SM_COUNT: dict[int, int] = {}


def decode_splits(rows: int, kv_heads: int, max_keys: int, block_n: int, device: torch.device) -> int:
    """Key splits a decode row's range is cut into (flash-decoding): enough (row, KV head, split)
    programs to fill the SMs DECODE_WAVES times over, at most one split per BLOCK_N keys of `max_keys`.

    `max_keys` is the block table's width times the block size, an upper bound on any row's range and
    static within a captured CUDA graph (its table is [rung, width]), as are rows and kv_heads, so a
    graph's split count never changes between replays. Each row cuts its own [lo, hi) into that many
    tile-aligned parts; the parts past a short row's end are empty and cost one store."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in _SM_COUNT:
            _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
        sms = _SM_COUNT[index]
    else:
        sms = 4  # the interpreter runs programs one by one: few splits keep CPU runs short
    want = -(-(DECODE_WAVES * sms) // max(1, rows * kv_heads))
    return max(1, min(want, -(-max_keys // block_n)))


def _interpreted() -> bool:
    """Under TRITON_INTERPRET=1 the prefill kernel's dots run in fp32: the interpreter's bf16 dot
    and bf16 casts are not the GPU's (it truncates where the GPU rounds to nearest)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def key_ranges(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mask [R, L] bool -> lo, hi [R] int32 (first allowed column, last + 1; 0, 0 where none) and
    whether every row's allowed keys are one run (then [lo, hi) is the mask exactly)."""
    length = mask.shape[-1]
    any_key = mask.any(dim=-1)
    as_int = mask.to(torch.int8)
    lo = torch.where(any_key, as_int.argmax(dim=-1), 0)
    hi = torch.where(any_key, length - as_int.flip(-1).argmax(dim=-1), 0)
    one_run = (mask.sum(dim=-1) == hi - lo).all()
    return lo.to(torch.int32), hi.to(torch.int32), one_run
