/* y = x @ W^T for weights kept quantized: AVX-512 VNNI integer dot products, as ggml does.
 *
 * Built by kvgen/model/quant/kernel.py with explicit flags (AVX-512 F/BW/VL/VNNI, FMA, F16C; never
 * -march=native, never AMX) and called through ctypes, only on CPUs that report those features.
 *
 * Weights [N, K] (see kvgen/model/quant/formats.py): unsigned codes u, an integer offset o, and per
 * group of G (32, or 16 for 8-bit) a scale s and an optional min m:  w = s * (u - o) + m.
 *     4-bit codes: 16 bytes per 32 weights, byte j = element j (low nibble) | element j+16 (high).
 *     8-bit codes: one byte per weight.
 *     scales and mins: fp32, or fp16 where the format's values are fp16 (Q4_0, Q4_1, Q8_0...).
 *
 * Each row of x is quantized once per call to int8 per group of 32 (as ggml's q8_0 activations):
 * sx = max|x| / 127, qx = round(x / sx), so x^ = sx * qx. Then for each weight group, exactly in int32,
 *     dot = sum (u - o) * qx = vpdpbusd(u, qx) - o * sum qx
 * and y = sum_g s_g * sx_g * dot_g + m_g * sx_g * sum_g qx, accumulated in fp32. The result is the
 * exact dot product of the dequantized W with x^, up to fp32 rounding of the scale products and sums.
 *
 * Work: OpenMP over blocks of output rows; inside, x's rows go four at a time over each weight row,
 * so a weight group is unpacked once for four rows. Every row of x goes through the same operations
 * whatever the number of rows, so a row's result does not depend on the rows beside it.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define XTILE 4          /* rows of x per tile */
#define WTILE 4          /* weight rows per tile */
#define ROW_BLOCK 16     /* weight rows per OpenMP work item */

/* x after quantization, for weight groups of `group` elements. */
struct xq {
    int8_t *q;       /* [T, K] */
    float *scale;    /* [T, K/32] */
    __m256i *init;   /* [T, K/32]: -offset * (sum of each 4 consecutive q): vpdpbusd's start value */
    float *sum;      /* [T, K/group]: scale * sum of q over each weight group */
};

static void quantize_row(const float *x, int64_t K, int32_t offset, int group, int8_t *q, float *scale,
                         __m256i *init, float *sum) {
    const __m256i ones = _mm256_set1_epi8(1);
    for (int64_t g = 0; g < K / 32; g++) {
        __m512 a = _mm512_loadu_ps(x + 32 * g), b = _mm512_loadu_ps(x + 32 * g + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        float s = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m128i qa = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv))));
        __m128i qb = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv))));
        __m256i qv = _mm256_inserti128_si256(_mm256_castsi128_si256(qa), qb, 1);
        _mm256_storeu_si256((__m256i *)(q + 32 * g), qv);
        scale[g] = s;
        __m256i lane_sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, qv);
        init[g] = _mm256_mullo_epi32(lane_sums, _mm256_set1_epi32(-offset));
        if (group == 32) {
            sum[g] = s * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(
                             _mm512_cvtepi8_epi32(_mm256_castsi256_si128(qv)), _mm512_cvtepi8_epi32(_mm256_extracti128_si256(qv, 1))));
        } else {
            sum[2 * g] = s * (float)_mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(qv)));
            sum[2 * g + 1] = s * (float)_mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(qv, 1)));
        }
    }
}

/* 32 codes as unsigned bytes in element order. */
static inline __attribute__((always_inline)) __m256i load_codes(const uint8_t *p, const int bits) {
    if (bits == 8)
        return _mm256_loadu_si256((const __m256i *)p);
    __m128i v = _mm_loadu_si128((const __m128i *)p);
    __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(v), _mm_srli_epi16(v, 4), 1);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

/* `count` (<= 16) consecutive fp16 or fp32 values as fp32, zeros after them. */
static inline __attribute__((always_inline)) __m512 load_values(const void *p, int64_t at, int count, const int f16) {
    __mmask16 m = (__mmask16)((1u << count) - 1);
    if (f16)
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p + at));
    return _mm512_maskz_loadu_ps(m, (const float *)p + at);
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* sum_g min_g * xsum_g over one weight row's groups, 16 at a time. */
static inline __attribute__((always_inline)) float min_term(const void *min, const float *xsum, int64_t groups,
                                                            const int f16) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g += 16) {
        int count = groups - g >= 16 ? 16 : (int)(groups - g);
        acc = _mm512_fmadd_ps(load_values(min, g, count, f16), load_values(xsum, g, count, 0), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

/* out[t0 .. t0+RX-1, n0 .. n0+RW-1]: a tile of RX rows of x by RW weight rows. Spans of 32 go eight
 * at a time: the products s_w * s_x of those eight (sixteen scales for groups of 16) are made with
 * one vector multiply per (weight row, x row) and read back one span at a time. Each output goes
 * through the same operations whatever the tile, so its value does not depend on RX, RW or T. */
static inline __attribute__((always_inline)) void tile(const struct xq *x, int64_t t0, const int RX, int64_t n0,
                                                       const int RW, int64_t K, const uint8_t *codes,
                                                       const void *scale, const void *min, int64_t N, float *out,
                                                       const int bits, const int group, const int f16) {
    const int64_t spans = K / 32, groups = K / group, row_bytes = K * bits / 8;
    const int per_span = 32 / group;
    const __m512i pairs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    __m256 acc[RW][RX];
    float prod[RW][RX][16] __attribute__((aligned(64)));
    for (int i = 0; i < RW; i++)
        for (int r = 0; r < RX; r++)
            acc[i][r] = _mm256_setzero_ps();
    for (int64_t g0 = 0; g0 < spans; g0 += 8) {
        const int count = spans - g0 >= 8 ? 8 : (int)(spans - g0);
        for (int r = 0; r < RX; r++) {
            __m512 sx = load_values(x->scale, (t0 + r) * spans + g0, count, 0);
            if (per_span == 2)
                sx = _mm512_permutexvar_ps(pairs, sx);
            for (int i = 0; i < RW; i++) {
                __m512 sw = load_values(scale, (n0 + i) * groups + g0 * per_span, count * per_span, f16);
                _mm512_store_ps(prod[i][r], _mm512_mul_ps(sw, sx));
            }
        }
        for (int j = 0; j < count; j++) {
            const int64_t g = g0 + j;
            __m256i u[RW];
            for (int i = 0; i < RW; i++)
                u[i] = load_codes(codes + (n0 + i) * row_bytes + g * 4 * bits, bits);
            for (int r = 0; r < RX; r++) {
                const int64_t span = (t0 + r) * spans + g;
                __m256i xq = _mm256_loadu_si256((const __m256i *)(x->q + 32 * span));
                for (int i = 0; i < RW; i++) {
                    __m256i dot = _mm256_dpbusd_epi32(x->init[span], u[i], xq);
                    __m256 s = per_span == 1 ? _mm256_broadcast_ss(&prod[i][r][j])
                                             : _mm256_set_m128(_mm_broadcast_ss(&prod[i][r][2 * j + 1]),
                                                               _mm_broadcast_ss(&prod[i][r][2 * j]));
                    acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, acc[i][r]);
                }
            }
        }
    }
    for (int i = 0; i < RW; i++)
        for (int r = 0; r < RX; r++) {
            float y = hsum(acc[i][r]);
            if (min)
                y += min_term((const char *)min + (n0 + i) * groups * (f16 ? 2 : 4), x->sum + (t0 + r) * groups,
                              groups, f16);
            out[(t0 + r) * N + n0 + i] = y;
        }
}

/* Weight rows n0 .. n1-1 against every row of x, in tiles of XTILE x rows by WTILE weight rows. */
static inline __attribute__((always_inline)) void row_block(const struct xq *x, int64_t T, int64_t K,
                                                            const uint8_t *codes, const void *scale, const void *min,
                                                            int64_t n0, int64_t n1, int64_t N, float *out,
                                                            const int bits, const int group, const int f16) {
    int64_t t = 0;
    for (; t + XTILE <= T; t += XTILE) {
        int64_t n = n0;
        for (; n + WTILE <= n1; n += WTILE)
            tile(x, t, XTILE, n, WTILE, K, codes, scale, min, N, out, bits, group, f16);
        for (; n < n1; n++)
            tile(x, t, XTILE, n, 1, K, codes, scale, min, N, out, bits, group, f16);
    }
    for (; t < T; t++) {
        int64_t n = n0;
        for (; n + WTILE <= n1; n += WTILE)
            tile(x, t, 1, n, WTILE, K, codes, scale, min, N, out, bits, group, f16);
        for (; n < n1; n++)
            tile(x, t, 1, n, 1, K, codes, scale, min, N, out, bits, group, f16);
    }
}

/* x quantized, in scratch space from aligned_alloc (the caller frees xq->init); 1 if out of memory. */
static int quantize_x(const float *x, int64_t T, int64_t K, int32_t offset, const int group, int threads,
                      struct xq *xq) {
    const int64_t spans = K / 32;
    /* per span: init (32 bytes), q (32), scale (4), sum (4, or 8 for groups of 16) */
    size_t bytes = (size_t)(T * spans * (32 + 32 + 4 + 8));
    char *scratch = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!scratch)
        return 1;
    xq->init = (__m256i *)scratch;
    xq->q = (int8_t *)(xq->init + T * spans);
    xq->scale = (float *)(xq->q + T * K);
    xq->sum = xq->scale + T * spans;
    #pragma omp parallel for num_threads(threads) schedule(static) if (T >= 16)
    for (int64_t t = 0; t < T; t++)
        quantize_row(x + t * K, K, offset, group, xq->q + t * K, xq->scale + t * spans, xq->init + t * spans,
                     xq->sum + t * (K / group));
    return 0;
}

/* One exported kernel per format. The parallel loop is written out in each, so that OpenMP's
 * outlined body is specialised for the format's constants (inside a shared inline function it is
 * outlined once, with bits/group/f16 as run-time values, and runs about three times slower).
 * Returns 0, or 1 when the scratch space for x cannot be allocated. */
#define KERNEL(name, bits, group, f16)                                                                        \
    int name(const float *x, int64_t T, int64_t K, const uint8_t *codes, const void *scale, const void *min,  \
             int32_t offset, int64_t N, float *out, int32_t num_threads) {                                    \
        int threads = num_threads < 1 ? 1 : num_threads;                                                     \
        struct xq xq;                                                                                         \
        if (quantize_x(x, T, K, offset, group, threads, &xq))                                                 \
            return 1;                                                                                         \
        int64_t blocks = (N + ROW_BLOCK - 1) / ROW_BLOCK;                                                     \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                                     \
        for (int64_t b = 0; b < blocks; b++) {                                                                \
            int64_t n1 = (b + 1) * ROW_BLOCK < N ? (b + 1) * ROW_BLOCK : N;                                   \
            row_block(&xq, T, K, codes, scale, min, b * ROW_BLOCK, n1, N, out, bits, group, f16);             \
        }                                                                                                     \
        free(xq.init);                                                                                        \
        return 0;                                                                                             \
    }

KERNEL(qmatmul_u4_g32_f16, 4, 32, 1)
KERNEL(qmatmul_u4_g32_f32, 4, 32, 0)
KERNEL(qmatmul_u8_g32_f16, 8, 32, 1)
KERNEL(qmatmul_u8_g32_f32, 8, 32, 0)
KERNEL(qmatmul_u8_g16_f32, 8, 16, 0)

/* x^ = scale * q for rows of x, exactly as the kernels quantize them (for tests). */
void quantize_activations(const float *x, int64_t T, int64_t K, int8_t *q, float *scale) {
    __m256i init;
    float sum[2];
    for (int64_t t = 0; t < T; t++)
        for (int64_t g = 0; g < K / 32; g++)
            quantize_row(x + t * K + 32 * g, 32, 0, 32, q + t * K + 32 * g, scale + t * (K / 32) + g, &init, sum);
}
