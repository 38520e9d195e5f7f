/* The loop of kvgen's few-row bf16 matmul kernels, y = x @ W^T, on weights in tiles of 4 rows: two
 * bytes a weight (bf16_matmul.c) or 12 bits (bf16_coded.c).
 *
 * Made for decode's few rows of x (a speculative verify chunk: up to ~16): each 64-byte load of a
 * weight row feeds up to 4 rows of x (x stays in cache), so the weights stream from memory once per
 * call, with software prefetch into L2 ahead (PREFETCH_L2). Work:
 * OpenMP over blocks of 4 weight rows; one thread below PARALLEL_BYTES of work (the weights' bytes,
 * and a share more for each 4 rows of x).
 * Every output goes through the same operations whatever T is, so a row's result does not depend on
 * the rows beside it. Each product is accumulated in fp32 over 16 lanes, the lanes are summed, and
 * the sum is stored as fp32 or rounded once to bf16 (nearest even), as oneDNN and torch round a bf16
 * matmul's fp32 accumulator.
 *
 * The including file defines, before #include:
 *   ELEM                 a weight's (and x's) element type
 *   SPAN, MASK           elements per span, and the mask type of one span
 *   VEC, LOAD(m, p)      the vector of a span, and a masked load of one
 *   DOT(acc, x, w)       acc (16 fp32 lanes) += the products of spans x and w
 *   ROW_STRIDE(K)        elements from one row of a 4-row weight block to the next
 *   SPAN_STEP            elements from one span of a block's row to the next
 *   BLOCK_START(b, K)    the element where block b (rows 4b..4b+3) starts
 * and may define (for weights stored otherwise than x, as bf16_coded.c does):
 *   XELEM, XLOAD(m, p)   x's element type and span load (default: ELEM and LOAD)
 *   WLOAD(m, p, r)       the span of weight row r (0-3) of a block at p (default: LOAD(m, p))
 *   FIX_SUMS(t, s0, s1, s2, s3)  a hook on the 4 fp32 sums of x row t0 + t (variables it may
 *                        change) before they are stored, given the call's `aux` pointer (default: none)
 */
#include <immintrin.h>
#include <stdint.h>

#include "bf16_bits.h"

#ifndef XELEM
#define XELEM ELEM
#define XLOAD LOAD
#endif
#ifndef WLOAD
#define WLOAD(m, p, r) LOAD(m, p)
#endif
#ifndef FIX_SUMS
#define FIX_SUMS(t, s0, s1, s2, s3) ((void)aux)
#endif

#define WROWS 4 /* weight rows per block */
#define XROWS 4 /* rows of x per pass over a block */
/* Software prefetch into L2, this far ahead of a block pass, of every line the pass reads per span
 * step. Builds alternated in one process over a SmolLM2 step's matrices at one row of x: one line
 * per step (the hardware prefetchers fetching the rest) was 7-19% faster than none (13.5 -> 11.4
 * ms, 12.8 -> 11.9, 17.8 -> 14.5), every line 10% faster again (bf16 13.2 -> 11.9 ms; coded, 6
 * lines a step, 12.8 -> 10.4), at 4-32 KiB ahead alike; into L1 (2-4 KiB ahead) was slower. */
#ifndef PREFETCH_L2
#define PREFETCH_L2 (16 << 10)
#endif
#define LINES_PER_STEP ((int)(SPAN_STEP * sizeof(ELEM) / 64))
/* Below this much work, one thread: the second's share would cost more to hand over than it saves.
 * OpenMP's workers spin briefly after each call (kvgen/threads.py), so a step's calls find the
 * second thread awake; from 256 KiB two threads read a bf16 step's weights ~8% faster than from
 * 1 MiB (which left SmolLM2's 660 KiB o projection to one thread). */
#ifndef PARALLEL_BYTES
#define PARALLEL_BYTES (256 << 10)
#endif

/* y[at] = sum, as fp32 or rounded to bf16. */
static inline void store(void *y, int64_t at, int f32, float sum) {
    if (f32)
        ((float *)y)[at] = sum;
    else
        ((uint16_t *)y)[at] = to_bf16(sum);
}

/* One pass of XR rows of x (t0...) over the 4 weight rows at w0..w3 (a block at the end of W repeats
 * its last row, and `rows` says how many to store). The accumulators are named variables, not an
 * array: gcc keeps an array of vectors on the stack. */
#define ACC(t) __m512 a##t##0 = _mm512_setzero_ps(), a##t##1 = a##t##0, a##t##2 = a##t##0, a##t##3 = a##t##0;
#define DOTS_OF(t)                                                                                        \
    {                                                                                                     \
        const VEC xv = XLOAD(m, x + (t0 + t) * K + k);                                                    \
        a##t##0 = DOT(a##t##0, xv, v0);                                                                   \
        a##t##1 = DOT(a##t##1, xv, v1);                                                                   \
        a##t##2 = DOT(a##t##2, xv, v2);                                                                   \
        a##t##3 = DOT(a##t##3, xv, v3);                                                                   \
    }
#define STORE(t)                                                                                          \
    {                                                                                                     \
        const int64_t at = (t0 + t) * N + n0;                                                             \
        float s0 = _mm512_reduce_add_ps(a##t##0), s1 = _mm512_reduce_add_ps(a##t##1);                     \
        float s2 = _mm512_reduce_add_ps(a##t##2), s3 = _mm512_reduce_add_ps(a##t##3);                     \
        FIX_SUMS(t, s0, s1, s2, s3);                                                                      \
        store(y, at, f32, s0);                                                                            \
        if (rows > 1) store(y, at + 1, f32, s1);                                                          \
        if (rows > 2) store(y, at + 2, f32, s2);                                                          \
        if (rows > 3) store(y, at + 3, f32, s3);                                                          \
    }
#define BLOCK(XR, ACCS, DOTS, STORES)                                                                     \
    static void block_x##XR(const XELEM *x, int64_t t0, int64_t K, const ELEM *w0, int64_t n0, int rows, \
                            int64_t N, void *y, int f32, const void *aux) {                               \
        ACCS                                                                                              \
        const int64_t stride = ROW_STRIDE(K), full = K / SPAN * SPAN, end = K % SPAN ? full + SPAN : full; \
        const MASK tail = (MASK)((1ull << (K % SPAN)) - 1u);                                              \
        const int lines = t0 == 0 ? LINES_PER_STEP : 0; /* later passes read the block from cache */       \
        const ELEM *w1 = w0 + (rows > 1) * stride, *w2 = w0 + (rows > 2) * 2 * stride;                    \
        const ELEM *w3 = w0 + (rows > 3) * 3 * stride;                                                    \
        for (int64_t k = 0; k < end; k += SPAN, w0 += SPAN_STEP, w1 += SPAN_STEP, w2 += SPAN_STEP,       \
                     w3 += SPAN_STEP) {                                                                   \
            const MASK m = k < full ? (MASK)~(MASK)0 : tail;                                              \
            for (int line = 0; line < lines; line++)                                                      \
                _mm_prefetch((const char *)w0 + PREFETCH_L2 + 64 * line, _MM_HINT_T1);                    \
            const VEC v0 = WLOAD(m, w0, 0), v1 = WLOAD(m, w1, 1), v2 = WLOAD(m, w2, 2);                    \
            const VEC v3 = WLOAD(m, w3, 3);                                                               \
            DOTS                                                                                          \
        }                                                                                                 \
        STORES                                                                                            \
    }
BLOCK(4, ACC(0) ACC(1) ACC(2) ACC(3), DOTS_OF(0) DOTS_OF(1) DOTS_OF(2) DOTS_OF(3), STORE(0) STORE(1) STORE(2) STORE(3))

BLOCK(1, ACC(0), DOTS_OF(0), STORE(0))
BLOCK(2, ACC(0) ACC(1), DOTS_OF(0) DOTS_OF(1), STORE(0) STORE(1))
BLOCK(3, ACC(0) ACC(1) ACC(2), DOTS_OF(0) DOTS_OF(1) DOTS_OF(2), STORE(0) STORE(1) STORE(2))

static void weight_block(const XELEM *x, int64_t T, int64_t K, const ELEM *w, int64_t b, int64_t N, void *y,
                         int f32, const void *aux) {
    const int64_t n0 = b * WROWS;
    const int rows = N - n0 < WROWS ? (int)(N - n0) : WROWS;
    const ELEM *block = w + BLOCK_START(b, K);
    for (int64_t t0 = 0; t0 < T; t0 += XROWS) {
        switch (T - t0 < XROWS ? T - t0 : XROWS) {
        case 1: block_x1(x, t0, K, block, n0, rows, N, y, f32, aux); break;
        case 2: block_x2(x, t0, K, block, n0, rows, N, y, f32, aux); break;
        case 3: block_x3(x, t0, K, block, n0, rows, N, y, f32, aux); break;
        default: block_x4(x, t0, K, block, n0, rows, N, y, f32, aux); break;
        }
    }
}

/* x [T, K], W [N, K] in the including file's layout, y [T, N] as fp32 (f32 set) or bf16; `aux` is
 * handed to FIX_SUMS. */
static void few_rows_matmul(const XELEM *x, int64_t T, int64_t K, const ELEM *w, int64_t N, void *y, int f32,
                            int num_threads, const void *aux) {
    const int64_t blocks = (N + WROWS - 1) / WROWS;
    const int64_t work = N * K * (int64_t)sizeof(ELEM) * (1 + T / XROWS);
    const int threads = num_threads > 1 && work >= PARALLEL_BYTES ? num_threads : 1;
    if (threads == 1) { /* no parallel region at all: entering even a serial one costs time */
        for (int64_t b = 0; b < blocks; b++)
            weight_block(x, T, K, w, b, N, y, f32, aux);
        return;
    }
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        weight_block(x, T, K, w, b, N, y, f32, aux);
}
