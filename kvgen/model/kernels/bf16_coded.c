/* y = x @ W^T on bf16 weights stored in 12 bits each, losslessly: the bf16 kernel's loop (few_rows.h)
 * on a quarter fewer bytes, for decode, which reads every weight once a token at memory speed.
 *
 * A bf16's high byte (sign and 7 of the 8 exponent bits) takes few values in a trained matrix
 * (formats/coded.py). So each weight keeps its low byte (the last exponent bit and the mantissa)
 * and a 4-bit code for its high byte, looked up in the matrix's 16-entry table; a weight whose
 * high byte is not in the table (an outlier: 0.018% of the SmolLM2 file's) is stored as +0
 * (top byte 0's code, low byte 0) and its product added to the fp32 sum of its row before the sum is
 * stored (FIX_SUMS). Without outliers a row's sums are bit for bit the bf16 kernel's: the same
 * weights meet the same x in the same order of vdpbf16ps.
 *
 * Layout (kvgen/model/kernels/coded.py, pack_bf16, packs it): tiles of 4 rows, K in spans of 64 columns; a
 * tile's span is 384 bytes, one sequential stream: the 4 rows' 64 low bytes, then their 32 code
 * bytes. Within a span the columns are stored in the order that vpunpck{l,h}bw of (low bytes,
 * looked-up high bytes) yields columns 0-31 and 32-63 as words; code byte j holds column j's code
 * (in that order) in its low nibble and column j + 32's in its high one. K is a multiple of 64.
 *
 * Built with explicit flags (AVX-512 F/BW/VL/BF16; never -march=native, never AMX).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "coded.h"

typedef struct {
    __m512bh lo, hi; /* columns 0-31 and 32-63 of a span */
} span64;

/* One row's span of weights as bf16 words, from its 64 low bytes at p and its 32 code bytes at c. */
static inline __attribute__((always_inline)) span64 decode_span(const uint8_t *p, const uint8_t *c, __m512i table) {
    const __m512i low = _mm512_loadu_si512(p);
    const __m512i codes = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)c));
    /* bytes 0-31: the low nibbles; bytes 32-63: the high ones */
    const __m512i index = _mm512_and_si512(_mm512_mask_srli_epi16(codes, 0xFFFF0000u, codes, 4), _mm512_set1_epi8(15));
    const __m512i high = _mm512_shuffle_epi8(table, index);
    return (span64){(__m512bh)_mm512_unpacklo_epi8(low, high), (__m512bh)_mm512_unpackhi_epi8(low, high)};
}

static inline __attribute__((always_inline)) span64 load_x(const uint16_t *p) {
    return (span64){(__m512bh)_mm512_loadu_si512(p), (__m512bh)_mm512_loadu_si512(p + 32)};
}

static inline __attribute__((always_inline)) __m512 dot_span(__m512 acc, span64 x, span64 w) {
    return _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc, x.lo, w.lo), x.hi, w.hi);
}

/* The outliers of tile n0 / 4 added to x row t0 + t's sums. */
static inline void fix_sums(const struct outliers *o, const uint16_t *x, int64_t t0, int t, int64_t K, int64_t n0,
                            float *s) {
    const int64_t b = n0 / 4;
    for (int64_t e = o->start[b]; e < o->start[b + 1]; e++) {
        const uint32_t bits = (uint32_t)x[(t0 + t) * K + (o->at[e] >> 2)] << 16;
        float xv;
        memcpy(&xv, &bits, sizeof xv);
        s[o->at[e] & 3] = fmaf(o->value[e], xv, s[o->at[e] & 3]); /* fused in every variant alike */
    }
}

struct coded_aux {
    struct outliers outliers;
    __m512i table; /* the 16 high bytes in every 128-bit lane: vpshufb looks up within lanes */
};

#define ELEM uint8_t
#define XELEM uint16_t
#define SPAN 64
#define MASK __mmask64
#define VEC span64
#define XLOAD(m, p) ((void)(m), load_x(p))
#define WLOAD(m, p, r) decode_span((p), (p) + 256 - 32 * (r), ((const struct coded_aux *)aux)->table)
#define DOT(acc, x, w) dot_span((acc), (x), (w))
#define FIX_SUMS(t, s0, s1, s2, s3)                                                                       \
    {                                                                                                     \
        float s[4] = {s0, s1, s2, s3};                                                                    \
        fix_sums(&((const struct coded_aux *)aux)->outliers, x, t0, (t), K, n0, s);                        \
        s0 = s[0], s1 = s[1], s2 = s[2], s3 = s[3];                                                       \
    }
#define ROW_STRIDE(K) 64
#define SPAN_STEP 384
#define BLOCK_START(b, K) ((b) * ((K) / 64) * 384)
#include "few_rows.h"

static __m512i table_of(const uint8_t *table) {
    return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)table));
}

/* x [T, K] bf16, w packed as coded.py (pack_bf16) lays it out, y [T, N] bf16, or fp32 when f32 is set. */
int bf16_coded_matmul_call(const struct coded_args *a) {
    const struct coded_aux aux = {a->outliers, table_of(a->table)};
    few_rows_matmul(a->x, a->T, a->K, a->w, a->N, a->y, a->f32, a->num_threads, &aux);
    return 0;
}

/* Where column k of row r of tile b goes in a decoded copy: row-major [N, K], or the bf16 kernel's
 * tiles of 4 rows stored 32 columns at a time (kernels/bf16.py). */
static inline int64_t decoded_at(int tiles_layout, int64_t b, int r, int64_t k, int64_t K) {
    if (tiles_layout)
        return ((b * (K / 32) + k / 32) * 4 + r) * 32 + k % 32;
    return (b * 4 + r) * K + k;
}

/* The packed weight decoded to bf16, outliers included, in either layout of decoded_at: for many rows
 * of x, where the bf16 kernel on its own tiles (or oneDNN's GEMM on row-major) beats decoding each
 * span again for every 4 rows. */
void bf16_coded_decode(const uint8_t *w, const uint8_t *table, struct outliers outliers, int64_t N, int64_t K,
                       uint16_t *out, int32_t tiles_layout, int32_t num_threads) {
    const __m512i lut = table_of(table);
    const int64_t spans = K / 64, tiles = (N + 3) / 4;
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t b = 0; b < tiles; b++) {
        for (int64_t s = 0; s < spans; s++)
            for (int r = 0; r < 4 && (tiles_layout || b * 4 + r < N); r++) {
                const uint8_t *p = w + (b * spans + s) * 384 + 64 * r;
                const span64 v = decode_span(p, p + 256 - 32 * r, lut);
                _mm512_storeu_si512(out + decoded_at(tiles_layout, b, r, 64 * s, K), (__m512i)v.lo);
                _mm512_storeu_si512(out + decoded_at(tiles_layout, b, r, 64 * s + 32, K), (__m512i)v.hi);
            }
        for (int64_t e = outliers.start[b]; e < outliers.start[b + 1]; e++) {
            uint32_t bits;
            memcpy(&bits, &outliers.value[e], sizeof bits);
            out[decoded_at(tiles_layout, b, outliers.at[e] & 3, outliers.at[e] >> 2, K)] = (uint16_t)(bits >> 16);
        }
    }
}

/* The packed weight decoded to fp32 in f32_matmul.c's panels [ceil(N / 32), K, 32] (zeros past N),
 * outliers included: for many rows of x on CPUs whose fp32 multiply-adds outrun their bf16 dot
 * products (kvgen/model/kernels/many_rows_choice.py). */
void bf16_coded_decode_f32(const uint8_t *w, const uint8_t *table, struct outliers outliers, int64_t N, int64_t K,
                           float *out, int32_t num_threads) {
    const __m512i lut = table_of(table);
    const int64_t spans = K / 64, tiles = (N + 3) / 4, panels = (N + 31) / 32;
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float *panel = out + p * K * 32;
        for (int64_t s = 0; s < spans; s++) {
            float rows[32][64]; /* the panel's 32 rows over this span, then written column by column */
            for (int at = 0; at < 32; at++) {
                const int64_t b = p * 8 + at / 4;
                const int r = at % 4;
                if (b >= tiles || b * 4 + r >= N) {
                    memset(rows[at], 0, sizeof rows[at]);
                    continue;
                }
                const uint8_t *q = w + (b * spans + s) * 384 + 64 * r;
                const span64 v = decode_span(q, q + 256 - 32 * r, lut);
                for (int h = 0; h < 4; h++) { /* 16 words at a time, widened: a bf16 is an fp32's high half */
                    const __m512i words = (__m512i)(h < 2 ? v.lo : v.hi);
                    const __m256i half = h % 2 ? _mm512_extracti64x4_epi64(words, 1) : _mm512_castsi512_si256(words);
                    _mm512_storeu_ps(rows[at] + 16 * h,
                                     _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16)));
                }
            }
            const __m512i down = _mm512_mullo_epi32( /* 16 rows of one column */
                _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(64));
            for (int c = 0; c < 64; c++) {
                _mm512_storeu_ps(panel + (64 * s + c) * 32, _mm512_i32gather_ps(down, &rows[0][c], 4));
                _mm512_storeu_ps(panel + (64 * s + c) * 32 + 16, _mm512_i32gather_ps(down, &rows[16][c], 4));
            }
        }
        for (int64_t b = p * 8; b < p * 8 + 8 && b < tiles; b++)
            for (int64_t e = outliers.start[b]; e < outliers.start[b + 1]; e++)
                panel[(outliers.at[e] >> 2) * 32 + (b % 8) * 4 + (outliers.at[e] & 3)] = outliers.value[e];
    }
}
