/* y = x @ W^T on fp32 weights stored in 28 bits each, losslessly: f32_matmul.c's panels and passes
 * on an eighth fewer bytes, for decode, which reads every weight once a token at memory speed.
 *
 * An fp32's top byte (sign and 7 of the 8 exponent bits) takes few values in a trained matrix, as a
 * bf16's high byte does (bf16_coded.c): each weight keeps its low 3 bytes and a 4-bit code of the top
 * byte, looked up in the matrix's 16-entry table; an outlier (a top byte outside the table) is stored
 * as +0 (top byte 0's code, low bytes 0) and its product added to its output after the multiply-add
 * chain.
 * Every output goes through the same operations whatever T is, so a row's bits still never depend on
 * the rows beside it; without outliers they are f32_matmul.c's bits (fma(x, +0, acc) is acc).
 *
 * Layout (kvgen/model/kernels/coded.py, pack_f32, packs it): panels of 32 output features, K steps of 112
 * bytes each: the 32 weights' low 3 bytes (little-endian, weight j at 3j), then 16 code bytes, byte
 * i holding weight i's code in its low nibble and weight i + 16's in its high one.
 *
 * A pass of up to 14 rows of x decodes each step in registers as it goes; where more rows follow, it
 * also stores the decoded panel in a per-thread buffer [K, 32], and f32_matmul.c's passes run the
 * rest of the rows on that (from cache).
 *
 * Built with explicit flags (AVX-512 F/BW/VBMI; never -march=native, never AMX).
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "coded.h"
#include "f32_passes.h"

#define STEP_BYTES 112

/* Byte 4i + c of a dword vector from byte 3i + c (c < 3); byte 3 of each dword is zeroed. */
static const uint8_t SPREAD[64] = {0,  1,  2,  0, 3,  4,  5,  0, 6,  7,  8,  0, 9,  10, 11, 0,
                                   12, 13, 14, 0, 15, 16, 17, 0, 18, 19, 20, 0, 21, 22, 23, 0,
                                   24, 25, 26, 0, 27, 28, 29, 0, 30, 31, 32, 0, 33, 34, 35, 0,
                                   36, 37, 38, 0, 39, 40, 41, 0, 42, 43, 44, 0, 45, 46, 47, 0};
#define LOW_BYTES 0x7777777777777777ull

/* A step's 32 weights as fp32, from its 112 bytes at q; `top` holds each code's top byte << 24. */
#define DECODE_STEP(q, top)                                                                               \
    const __m512i spread = _mm512_loadu_si512(SPREAD);                                                    \
    const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)((q) + 96)));            \
    const __m512 w_lo = _mm512_castsi512_ps(_mm512_or_si512(                                              \
        _mm512_maskz_permutexvar_epi8(LOW_BYTES, spread, _mm512_loadu_si512(q)),                          \
        _mm512_permutexvar_epi32(codes, top)));                                                           \
    const __m512 w_hi = _mm512_castsi512_ps(_mm512_or_si512(                                              \
        _mm512_maskz_permutexvar_epi8(LOW_BYTES, spread, _mm512_loadu_si512((q) + 48)),                   \
        _mm512_permutexvar_epi32(_mm512_srli_epi32(codes, 4), top)));

/* One pass of R rows of x over a coded panel: f32_matmul.c's pass, decoding each step; where `keep`
 * is not NULL, the decoded panel [K, 32] is also stored there, for the passes after. */
#define CODED_PASS(R)                                                                                     \
    static void coded_x##R(const float *x, int64_t K, const uint8_t *q, __m512i top, float *y, int64_t N, \
                           int64_t left, float *keep) {                                                   \
        UP_TO_##R(ACC)                                                                                    \
        for (int64_t k = 0; k < K; k++, q += STEP_BYTES) {                                                \
            _mm_prefetch((const char *)q + PREFETCH_L2, _MM_HINT_T1);                                     \
            _mm_prefetch((const char *)q + PREFETCH_L2 + 64, _MM_HINT_T1);                                \
            DECODE_STEP(q, top)                                                                           \
            if (keep) {                                                                                   \
                _mm512_storeu_ps(keep + k * PANEL, w_lo);                                                 \
                _mm512_storeu_ps(keep + k * PANEL + 16, w_hi);                                            \
            }                                                                                             \
            UP_TO_##R(FMA)                                                                                \
        }                                                                                                 \
        MASKS                                                                                             \
        UP_TO_##R(STORE)                                                                                  \
    }
CODED_PASS(1) CODED_PASS(2) CODED_PASS(3) CODED_PASS(4) CODED_PASS(5) CODED_PASS(6) CODED_PASS(7)
CODED_PASS(8) CODED_PASS(9) CODED_PASS(10) CODED_PASS(11) CODED_PASS(12) CODED_PASS(13) CODED_PASS(14)

typedef void (*coded_pass_fn)(const float *, int64_t, const uint8_t *, __m512i, float *, int64_t, int64_t,
                              float *);
static const coded_pass_fn CODED_PASSES[MAX_ROWS + 1] = {
    0, coded_x1, coded_x2, coded_x3, coded_x4, coded_x5, coded_x6, coded_x7, coded_x8, coded_x9, coded_x10,
    coded_x11, coded_x12, coded_x13, coded_x14};

/* Panel p's outliers' products added to every row's outputs, each as one fused multiply-add:
 * written as `y += w * x`, gcc contracts it or not depending on whether it vectorizes the loop over
 * rows, and a row's bits would depend on the row count. */
static void add_outliers(const struct coded_args *a, int64_t p) {
    const struct outliers *o = &a->outliers;
    for (int64_t t = 0; t < a->T; t++) { /* row by row: its x and its 32 outputs stay in cache */
        const float *x = (const float *)a->x + t * a->K;
        float *y = (float *)a->y + t * a->N + p * PANEL;
        for (int64_t e = o->start[p]; e < o->start[p + 1]; e++)
            y[o->at[e] & 31] = fmaf(o->value[e], x[o->at[e] >> 5], y[o->at[e] & 31]);
    }
}

/* Every row of x over panel p: the first pass decodes as it goes (into `buffer` [K, 32] floats
 * where more passes follow), the passes after run f32_matmul.c's passes on the decoded panel. */
static void coded_panel_rows(const struct coded_args *a, __m512i top, int64_t p, float *buffer) {
    const int64_t K = a->K, N = a->N, n0 = p * PANEL, left = N - n0;
    const int64_t first = a->T < MAX_ROWS ? a->T : MAX_ROWS;
    const float *x = a->x;
    float *y = a->y;
    CODED_PASSES[first](x, K, a->w + p * K * STEP_BYTES, top, y + n0, N, left, a->T > first ? buffer : NULL);
    for (int64_t t = first; t < a->T; t += MAX_ROWS) {
        const int64_t rows = a->T - t < MAX_ROWS ? a->T - t : MAX_ROWS;
        PASSES[rows](x + t * K, K, buffer, y + t * N + n0, N, left);
    }
    add_outliers(a, p);
}

/* Panels [first, last) of the call on this thread; nonzero when its buffer could not be had. */
static int panels_of(const struct coded_args *a, __m512i top, int64_t first, int64_t last) {
    float *buffer = NULL;
    if (a->T > MAX_ROWS && !(buffer = aligned_alloc(64, (size_t)(a->K * PANEL * sizeof(float) + 63) / 64 * 64)))
        return 1;
    for (int64_t p = first; p < last; p++)
        coded_panel_rows(a, top, p, buffer);
    free(buffer);
    return 0;
}

/* y [T, N] = x [T, K] @ W^T, W coded as above; nonzero when out of memory. */
int f32_coded_matmul_call(const struct coded_args *a) {
    const __m512i top = _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)a->table)), 24);
    const int64_t panels = (a->N + PANEL - 1) / PANEL;
    const int64_t work = a->N * a->K * (int64_t)sizeof(float) * (1 + a->T / MAX_ROWS);
    const int threads = a->num_threads > 1 && work >= PARALLEL_BYTES ? a->num_threads : 1;
    if (threads == 1) /* no parallel region at all: entering even a serial one costs time */
        return panels_of(a, top, 0, panels);
    int failed = 0;
    #pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        const int64_t share = (panels + threads - 1) / threads, first = omp_get_thread_num() * share;
        failed |= panels_of(a, top, first < panels ? first : panels, first + share < panels ? first + share : panels);
    }
    return failed;
}

/* Rows ids [T] of W [N, K] -> out [T, K] fp32, outliers included (a tied embedding's lookup). */
void f32_coded_rows(const uint8_t *w, const uint8_t *table, struct outliers o, int64_t K, const int64_t *ids,
                    int64_t T, float *out) {
    for (int64_t t = 0; t < T; t++) {
        const int64_t p = ids[t] / PANEL, j = ids[t] % PANEL;
        float *row = out + t * K;
        for (int64_t k = 0; k < K; k++) {
            const uint8_t *q = w + (p * K + k) * STEP_BYTES;
            const uint32_t code = q[96 + j % 16] >> (4 * (j / 16)) & 15u;
            const uint32_t bits = q[3 * j] | (uint32_t)q[3 * j + 1] << 8 | (uint32_t)q[3 * j + 2] << 16 |
                                  (uint32_t)table[code] << 24;
            memcpy(row + k, &bits, sizeof bits);
        }
        for (int64_t e = o.start[p]; e < o.start[p + 1]; e++)
            if ((o.at[e] & 31) == j)
                row[o.at[e] >> 5] = o.value[e];
    }
}
