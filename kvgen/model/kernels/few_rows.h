/* The loop of kvgen's few-row matmul kernels, y = x @ W^T, shared by bf16_matmul.c and f32_matmul.c.
 *
 * Made for decode's few rows of x (a speculative verify chunk: up to ~16): each 64-byte load of a
 * weight row feeds up to 4 rows of x (15 in the row passes below; x stays in cache), so the weights
 * stream from memory once per call, with software prefetch into L2 ahead (PREFETCH_L2). Work:
 * OpenMP over blocks of 4 weight rows; one thread below PARALLEL_BYTES of work (the weights' bytes,
 * and a share more for each 4 rows of x).
 * Every output goes through the same operations whatever T is, so a row's result does not depend on
 * the rows beside it. Each product is accumulated in fp32 over 16 lanes, the lanes are summed, and
 * the sum is stored as fp32 or rounded once to bf16 (nearest even), as oneDNN and torch round a bf16
 * matmul's fp32 accumulator.
 *
 * The including file defines, before #include:
 *   ELEM                 a weight's (and x's) element type
 *   SPAN, MASK           elements per 64-byte span, and the mask type of one span
 *   VEC, LOAD(m, p)      the vector of a span, and a masked load of one
 *   DOT(acc, x, w)       acc (16 fp32 lanes) += the products of spans x and w
 *   ROW_STRIDE(K)        elements from one row of a 4-row weight block to the next
 *   SPAN_STEP            elements from one span of a block's row to the next
 *   BLOCK_START(b, K)    the element where block b (rows 4b..4b+3) starts
 *   ROWS_CONTIGUOUS      (optional) weight rows are contiguous: few rows of x go row by row
 */
#include <immintrin.h>
#include <stdint.h>

#include "bf16_bits.h"

#define WROWS 4 /* weight rows per block */
#define XROWS 4 /* rows of x per pass over a block */
/* Software prefetch into L2, this far ahead of the first row's stream of a block pass (one line per
 * span: the hardware prefetchers fetch the rest) and of a row pass of 2-8 rows of x. Builds
 * alternated in one process over a SmolLM2 step's matrices: bf16 at one row of x 7-19% faster
 * (13.5 -> 11.4 ms, 12.8 -> 11.9, 17.8 -> 14.5), fp32 at 5 rows 32.7 -> 20.2 ms and at 9 41.6 ->
 * 32.9, 3-4% at 64 rows; software prefetch into L1 1 KiB ahead had made one row slower instead. */
#ifndef PREFETCH_L2
#define PREFETCH_L2 (16 << 10)
#endif
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
        const VEC xv = LOAD(m, x + (t0 + t) * K + k);                                                     \
        a##t##0 = DOT(a##t##0, xv, v0);                                                                   \
        a##t##1 = DOT(a##t##1, xv, v1);                                                                   \
        a##t##2 = DOT(a##t##2, xv, v2);                                                                   \
        a##t##3 = DOT(a##t##3, xv, v3);                                                                   \
    }
#define STORE(t)                                                                                          \
    {                                                                                                     \
        const int64_t at = (t0 + t) * N + n0;                                                             \
        store(y, at, f32, _mm512_reduce_add_ps(a##t##0));                                                 \
        if (rows > 1) store(y, at + 1, f32, _mm512_reduce_add_ps(a##t##1));                               \
        if (rows > 2) store(y, at + 2, f32, _mm512_reduce_add_ps(a##t##2));                               \
        if (rows > 3) store(y, at + 3, f32, _mm512_reduce_add_ps(a##t##3));                               \
    }
#define BLOCK(XR, ACCS, DOTS, STORES)                                                                     \
    static void block_x##XR(const ELEM *x, int64_t t0, int64_t K, const ELEM *w0, int64_t n0, int rows,  \
                            int64_t N, void *y, int f32) {                                                \
        ACCS                                                                                              \
        const int64_t stride = ROW_STRIDE(K), full = K / SPAN * SPAN, end = K % SPAN ? full + SPAN : full; \
        const MASK tail = (MASK)((1ull << (K % SPAN)) - 1u);                                              \
        const ELEM *w1 = w0 + (rows > 1) * stride, *w2 = w0 + (rows > 2) * 2 * stride;                    \
        const ELEM *w3 = w0 + (rows > 3) * 3 * stride;                                                    \
        for (int64_t k = 0; k < end; k += SPAN, w0 += SPAN_STEP, w1 += SPAN_STEP, w2 += SPAN_STEP,       \
                     w3 += SPAN_STEP) {                                                                   \
            const MASK m = k < full ? (MASK)~(MASK)0 : tail;                                              \
            _mm_prefetch((const char *)w0 + PREFETCH_L2, _MM_HINT_T1);                                    \
            const VEC v0 = LOAD(m, w0), v1 = LOAD(m, w1), v2 = LOAD(m, w2), v3 = LOAD(m, w3);             \
            DOTS                                                                                          \
        }                                                                                                 \
        STORES                                                                                            \
    }
BLOCK(4, ACC(0) ACC(1) ACC(2) ACC(3), DOTS_OF(0) DOTS_OF(1) DOTS_OF(2) DOTS_OF(3), STORE(0) STORE(1) STORE(2) STORE(3))

#ifdef ROWS_CONTIGUOUS
/* For a layout whose weight rows are contiguous (ROW_STRIDE(K) == K, SPAN_STEP == SPAN): passes of
 * up to ROW_PASS rows of x that go one weight row at a time, so the block is read as one sequential
 * stream, which the hardware prefetchers follow faster than block_x4's 4 interleaved ones. They run
 * every pass of a call with fewer than ROW_PASS_BELOW rows of x (decode, a speculative verify chunk:
 * memory-bound; a SmolLM2 fp32 step's matrices at one row, in a microbenchmark, 24 -> 32 GB/s) and
 * the last 1-3 rows of larger ones; block_x4 does the rest (compute-bound, where its 16
 * accumulators need fewer loads per multiply-add). Each output accumulates over the same spans in
 * the same order in both: the same bits.
 * A call of up to ROW_PASS rows is one pass, so its weights are read once: a 9-row verify chunk
 * (K = 8) over a SmolLM2 fp32 step's matrices went 32.0 -> 28.7 ms against passes of 8 and 1. */
#ifndef ROW_PASS_BELOW
#define ROW_PASS_BELOW 16
#endif
#define ROW_PASS 15 /* the most rows of x one pass takes: rows_x1 .. rows_x15 below */
#define ROW_ACC(t) __m512 a##t = _mm512_setzero_ps();
#define ROW_DOT(t) a##t = DOT(a##t, LOAD(m, x + (t0 + t) * K + k), v);
#define ROW_STORE(t) store(y, (t0 + t) * N + n0 + r, f32, _mm512_reduce_add_ps(a##t));
#define ROWS(XR, ACCS, DOTS, STORES)                                                                      \
    static void rows_x##XR(const ELEM *x, int64_t t0, int64_t K, const ELEM *block, int64_t n0, int rows, \
                           int64_t N, void *y, int f32) {                                                 \
        const int64_t full = K / SPAN * SPAN, end = K % SPAN ? full + SPAN : full;                        \
        const MASK tail = (MASK)((1ull << (K % SPAN)) - 1u);                                              \
        for (int r = 0; r < rows; r++) {                                                                  \
            const ELEM *w = block + r * K;                                                                \
            ACCS                                                                                          \
            for (int64_t k = 0; k < end; k += SPAN) {                                                     \
                const MASK m = k < full ? (MASK)~(MASK)0 : tail;                                          \
                if (XR > 1)                                                                               \
                    _mm_prefetch((const char *)(w + k) + PREFETCH_L2, _MM_HINT_T1);                      \
                const VEC v = LOAD(m, w + k);                                                             \
                DOTS                                                                                      \
            }                                                                                             \
            STORES                                                                                        \
        }                                                                                                 \
    }
#define UP_TO_1(F) F(0)
#define UP_TO_2(F) UP_TO_1(F) F(1)
#define UP_TO_3(F) UP_TO_2(F) F(2)
#define UP_TO_4(F) UP_TO_3(F) F(3)
#define UP_TO_5(F) UP_TO_4(F) F(4)
#define UP_TO_6(F) UP_TO_5(F) F(5)
#define UP_TO_7(F) UP_TO_6(F) F(6)
#define UP_TO_8(F) UP_TO_7(F) F(7)
#define UP_TO_9(F) UP_TO_8(F) F(8)
#define UP_TO_10(F) UP_TO_9(F) F(9)
#define UP_TO_11(F) UP_TO_10(F) F(10)
#define UP_TO_12(F) UP_TO_11(F) F(11)
#define UP_TO_13(F) UP_TO_12(F) F(12)
#define UP_TO_14(F) UP_TO_13(F) F(13)
#define UP_TO_15(F) UP_TO_14(F) F(14)
#define ROWS_OF(XR) ROWS(XR, UP_TO_##XR(ROW_ACC), UP_TO_##XR(ROW_DOT), UP_TO_##XR(ROW_STORE))
ROWS_OF(1)
ROWS_OF(2)
ROWS_OF(3)
ROWS_OF(4)
ROWS_OF(5)
ROWS_OF(6)
ROWS_OF(7)
ROWS_OF(8)
ROWS_OF(9)
ROWS_OF(10)
ROWS_OF(11)
ROWS_OF(12)
ROWS_OF(13)
ROWS_OF(14)
ROWS_OF(15)

/* Rows t0 .. t0 + count - 1 of x (count <= ROW_PASS) by the block, row by row. */
static void row_pass(const ELEM *x, int64_t t0, int count, int64_t K, const ELEM *block, int64_t n0, int rows,
                     int64_t N, void *y, int f32) {
    switch (count) {
    case 1: rows_x1(x, t0, K, block, n0, rows, N, y, f32); break;
    case 2: rows_x2(x, t0, K, block, n0, rows, N, y, f32); break;
    case 3: rows_x3(x, t0, K, block, n0, rows, N, y, f32); break;
    case 4: rows_x4(x, t0, K, block, n0, rows, N, y, f32); break;
    case 5: rows_x5(x, t0, K, block, n0, rows, N, y, f32); break;
    case 6: rows_x6(x, t0, K, block, n0, rows, N, y, f32); break;
    case 7: rows_x7(x, t0, K, block, n0, rows, N, y, f32); break;
    case 8: rows_x8(x, t0, K, block, n0, rows, N, y, f32); break;
    case 9: rows_x9(x, t0, K, block, n0, rows, N, y, f32); break;
    case 10: rows_x10(x, t0, K, block, n0, rows, N, y, f32); break;
    case 11: rows_x11(x, t0, K, block, n0, rows, N, y, f32); break;
    case 12: rows_x12(x, t0, K, block, n0, rows, N, y, f32); break;
    case 13: rows_x13(x, t0, K, block, n0, rows, N, y, f32); break;
    case 14: rows_x14(x, t0, K, block, n0, rows, N, y, f32); break;
    default: rows_x15(x, t0, K, block, n0, rows, N, y, f32); break;
    }
}

static void weight_block(const ELEM *x, int64_t T, int64_t K, const ELEM *w, int64_t b, int64_t N, void *y,
                         int f32) {
    const int64_t n0 = b * WROWS;
    const int rows = N - n0 < WROWS ? (int)(N - n0) : WROWS;
    const ELEM *block = w + BLOCK_START(b, K);
    int64_t t0 = 0;
    if (T >= ROW_PASS_BELOW)
        for (; t0 + XROWS <= T; t0 += XROWS)
            block_x4(x, t0, K, block, n0, rows, N, y, f32);
    for (; t0 < T; t0 += ROW_PASS)
        row_pass(x, t0, T - t0 < ROW_PASS ? (int)(T - t0) : ROW_PASS, K, block, n0, rows, N, y, f32);
}
#else
BLOCK(1, ACC(0), DOTS_OF(0), STORE(0))
BLOCK(2, ACC(0) ACC(1), DOTS_OF(0) DOTS_OF(1), STORE(0) STORE(1))
BLOCK(3, ACC(0) ACC(1) ACC(2), DOTS_OF(0) DOTS_OF(1) DOTS_OF(2), STORE(0) STORE(1) STORE(2))

static void weight_block(const ELEM *x, int64_t T, int64_t K, const ELEM *w, int64_t b, int64_t N, void *y,
                         int f32) {
    const int64_t n0 = b * WROWS;
    const int rows = N - n0 < WROWS ? (int)(N - n0) : WROWS;
    const ELEM *block = w + BLOCK_START(b, K);
    for (int64_t t0 = 0; t0 < T; t0 += XROWS) {
        switch (T - t0 < XROWS ? T - t0 : XROWS) {
        case 1: block_x1(x, t0, K, block, n0, rows, N, y, f32); break;
        case 2: block_x2(x, t0, K, block, n0, rows, N, y, f32); break;
        case 3: block_x3(x, t0, K, block, n0, rows, N, y, f32); break;
        default: block_x4(x, t0, K, block, n0, rows, N, y, f32); break;
        }
    }
}
#endif

/* x [T, K], W [N, K] in the including file's layout, y [T, N] as fp32 (f32 set) or bf16. */
static void few_rows_matmul(const ELEM *x, int64_t T, int64_t K, const ELEM *w, int64_t N, void *y, int f32,
                            int num_threads) {
    const int64_t blocks = (N + WROWS - 1) / WROWS;
    const int64_t work = N * K * (int64_t)sizeof(ELEM) * (1 + T / XROWS);
    const int threads = num_threads > 1 && work >= PARALLEL_BYTES ? num_threads : 1;
    if (threads == 1) { /* no parallel region at all: entering even a serial one costs time */
        for (int64_t b = 0; b < blocks; b++)
            weight_block(x, T, K, w, b, N, y, f32);
        return;
    }
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        weight_block(x, T, K, w, b, N, y, f32);
}
