/* y = x @ W^T in bf16: AVX-512 BF16 dot products (vdpbf16ps), made for decode's few rows of x.
 *
 * Built by kvgen/model/kernels/bf16.py with explicit flags (AVX-512 F/BW/VL/BF16; never
 * -march=native, never AMX) and called through ctypes, only on CPUs that report those features.
 *
 * W [N, K] bf16, packed once at load (kvgen/model/kernels/bf16.py) in tiles of 4 rows stored span
 * (32 columns) by span, K padded with zeros to whole spans: a thread reads one sequential stream,
 * where 4 row streams per thread read the LM head from memory at half the speed. x [T, K] bf16,
 * y [T, N] bf16 (or fp32, for the quantized layers' many-row path). Each product is accumulated in
 * fp32 over 16 lanes (vdpbf16ps adds the products of two adjacent pairs into each lane), the lanes
 * are summed, and the sum is rounded once to bf16 (nearest even), as oneDNN and torch round a bf16
 * matmul's fp32 accumulator.
 *
 * Why not oneDNN: at one row its bf16 GEMV reads the mid-size matrices of a small model (576 x 1536)
 * at a third of the memory's speed, slower than fp32 OpenBLAS on twice the bytes (BENCHMARKS.md).
 * This kernel streams the weights once per call: each 64-byte load of a weight row feeds up to 4
 * rows of x (x stays in cache), with software prefetch ahead in the stream.
 *
 * Work: OpenMP over blocks of 4 weight rows; one thread below PARALLEL_BYTES of work (the weights'
 * bytes, and a share more for each 4 rows of x). Every output goes through the same operations
 * whatever T is, so a row's result does not depend on the rows beside it.
 */
#include <immintrin.h>
#include <stdint.h>

#define WROWS 4 /* weight rows per block */
#define XROWS 4 /* rows of x per pass over a block */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 1024
#endif
/* Below this much work, one thread: waking the second costs more than it saves
 * (OpenMP's workers sleep between calls, see kvgen/threads.py). */
#ifndef PARALLEL_BYTES
#define PARALLEL_BYTES (1 << 20)
#endif

static inline uint16_t round_to_bf16(float f) {
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) /* NaN stays NaN */
        return (uint16_t)((v.u >> 16) | 0x40);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* y[at] = sum, as fp32 or rounded to bf16. */
static inline void store(void *y, int64_t at, int f32, float sum) {
    if (f32)
        ((float *)y)[at] = sum;
    else
        ((uint16_t *)y)[at] = round_to_bf16(sum);
}

/* The K-tail mask for 16-bit elements: K % 32 of them. */
static inline __mmask32 tail_mask(int64_t K) {
    const int64_t rest = K % 32;
    return rest ? (__mmask32)((1u << rest) - 1u) : 0;
}

/* One pass of XR rows of x (t0...) over 4 weight rows (w0..w3, pointers to row starts; a block at
 * the end of W repeats its last row and `rows` says how many to store). The accumulators are named
 * variables, not an array: gcc keeps an array of vectors on the stack. */
#define ACC(t) __m512 a##t##0 = _mm512_setzero_ps(), a##t##1 = a##t##0, a##t##2 = a##t##0, a##t##3 = a##t##0;
#define DOT(t)                                                                                            \
    {                                                                                                     \
        const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + (t0 + t) * K + k);                \
        a##t##0 = _mm512_dpbf16_ps(a##t##0, xv, v0);                                                    \
        a##t##1 = _mm512_dpbf16_ps(a##t##1, xv, v1);                                                    \
        a##t##2 = _mm512_dpbf16_ps(a##t##2, xv, v2);                                                    \
        a##t##3 = _mm512_dpbf16_ps(a##t##3, xv, v3);                                                    \
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
    static void block_x##XR(const uint16_t *x, int64_t t0, int64_t K, const uint16_t *tile, int64_t n0,  \
                            int rows, int64_t N, void *y, int f32) {                                      \
        ACCS                                                                                              \
        const int64_t full = K / 32 * 32, end = K % 32 ? full + 32 : full;                                \
        const __mmask32 tail = tail_mask(K);                                                              \
        for (int64_t k = 0; k < end; k += 32, tile += WROWS * 32) {                                       \
            const __mmask32 m = k < full ? (__mmask32)0xffffffffu : tail;                                 \
            _mm_prefetch((const char *)tile + PREFETCH_BYTES, _MM_HINT_T0);                               \
            _mm_prefetch((const char *)tile + PREFETCH_BYTES + 64, _MM_HINT_T0);                          \
            _mm_prefetch((const char *)tile + PREFETCH_BYTES + 128, _MM_HINT_T0);                         \
            _mm_prefetch((const char *)tile + PREFETCH_BYTES + 192, _MM_HINT_T0);                         \
            const __m512bh v0 = (__m512bh)_mm512_loadu_si512(tile), v1 = (__m512bh)_mm512_loadu_si512(tile + 32); \
            const __m512bh v2 = (__m512bh)_mm512_loadu_si512(tile + 64), v3 = (__m512bh)_mm512_loadu_si512(tile + 96); \
            DOTS                                                                                          \
        }                                                                                                 \
        STORES                                                                                            \
    }
BLOCK(1, ACC(0), DOT(0), STORE(0))
BLOCK(2, ACC(0) ACC(1), DOT(0) DOT(1), STORE(0) STORE(1))
BLOCK(3, ACC(0) ACC(1) ACC(2), DOT(0) DOT(1) DOT(2), STORE(0) STORE(1) STORE(2))
BLOCK(4, ACC(0) ACC(1) ACC(2) ACC(3), DOT(0) DOT(1) DOT(2) DOT(3), STORE(0) STORE(1) STORE(2) STORE(3))

static void weight_block(const uint16_t *x, int64_t T, int64_t K, const uint16_t *w, int64_t b, int64_t N,
                         void *y, int f32) {
    const int64_t n0 = b * WROWS, spans = (K + 31) / 32;
    const int rows = N - n0 < WROWS ? (int)(N - n0) : WROWS;
    const uint16_t *tile = w + b * spans * WROWS * 32;
    for (int64_t t0 = 0; t0 < T; t0 += XROWS) {
        switch (T - t0 < XROWS ? T - t0 : XROWS) {
        case 1: block_x1(x, t0, K, tile, n0, rows, N, y, f32); break;
        case 2: block_x2(x, t0, K, tile, n0, rows, N, y, f32); break;
        case 3: block_x3(x, t0, K, tile, n0, rows, N, y, f32); break;
        default: block_x4(x, t0, K, tile, n0, rows, N, y, f32); break;
        }
    }
}

/* x [T, K] bf16, w packed as kernels/bf16.py's pack() lays it out (tiles of 4 rows, K padded to
 * spans of 32), y [T, N] bf16, or fp32 (the unrounded sums) when f32 is set. */
void bf16_matmul(const uint16_t *x, int64_t T, int64_t K, const uint16_t *w, int64_t N, void *y, int32_t f32,
                 int32_t num_threads) {
    const int64_t blocks = (N + WROWS - 1) / WROWS;
    const int threads = num_threads > 1 && N * K * 2 * (1 + T / 4) >= PARALLEL_BYTES ? num_threads : 1;
    if (threads == 1) { /* no parallel region at all: entering even a serial one costs time */
        for (int64_t b = 0; b < blocks; b++)
            weight_block(x, T, K, w, b, N, y, f32);
        return;
    }
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        weight_block(x, T, K, w, b, N, y, f32);
}
