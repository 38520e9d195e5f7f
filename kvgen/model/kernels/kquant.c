/* y = x @ W^T for GGUF K-quant weights (Q4_K, Q5_K, Q6_K) kept in a layout close to the file's:
 * integer dot products, one pass of the weights for any number of rows of x.
 *
 * One source, two builds, as qmatmul.c (qvec.h's vectors): AVX-512 VNNI, or AVX2 with FMA and F16C,
 * which give the same bits (every code is below 64, so AVX2's int16 pair sums of code * x never
 * saturate). Built by kvgen/model/kernels/kquant.py with explicit flags (never -march=native, never
 * AMX) and loaded only on CPUs that report them.
 *
 * Layout (kvgen/model/formats/kquant.py packs it): rows in panels of 16 (the last padded with
 * zero rows), each panel stored super-block (256 columns) by super-block as one stream. A block:
 *     meta  320 bytes  Q4_K/Q5_K: sc uint8 [8 sub-blocks][16 rows], m uint8 [8][16], d fp16 [16],
 *                      dmin fp16 [16];  Q6_K: sc int8 [16 sub-blocks][16 rows], d fp16 [16], 32 zero
 *     low   2048 bytes the low 4 bits of the codes: per 32-column sub-block s, 4 vectors v of 64
 *                      bytes, lane n (4 bytes, row n) byte b: code[n][32s+8v+b] | code[n][32s+8v+4+b] << 4
 *     high  Q5_K 512 bytes: per sub-block one vector, lane n bit 8b+g = bit 4 of code[n][32s+4g+b];
 *           Q6_K 1024 bytes: per sub-block two vectors (g < 4, g >= 4), lane n bits 8b+2(g%4)..+1 =
 *           bits 4-5 of code[n][32s+4g+b]
 * so after unpacking, vector g of a sub-block holds 4 consecutive codes (columns 32s+4g..+3) of each
 * of the 16 rows, one row per int32 lane: vpdpbusd with x's 4 bytes broadcast gives each row's sum
 * in its own lane, and a lane's sums never need a horizontal reduction.
 * Values (as gguf): Q4_K/Q5_K w = d*sc*q - dmin*m per 32; Q6_K w = d*sc*(q - 32) per 16.
 *
 * Each row of x is quantized once per call to int8 per 32 (sx = max|x| / 127, q = round(x / sx), as
 * qmatmul.c), optionally in two parts (the second quantizes the first's rounding error). Then per
 * sub-block and row of x, exactly in int32, dot = sum q_w * q_x, and in fp32
 *     Q4_K/Q5_K  y += (d*sc) * sx * dot - (dmin*m) * (sx * sum q_x)
 *     Q6_K       y += (d*sc) * sx * (dot - 32 * sum q_x)     per 16 columns
 * the exact dot product of the dequantized W with x^, up to fp32 rounding of the scale products and
 * of the sums.
 *
 * out[t, n] is at out + t * ldo + n (ldo >= N: a slice of a wider output, as side-by-side layers write).
 *
 * Work: rows of x in chunks of XCHUNK (their int8 copy stays in L2); per chunk the panels are split
 * among the threads, each thread getting the same panels in every chunk so that it goes on to the
 * next chunk without waiting for the others (one barrier a call, not one a chunk: OpenMP's spinning
 * was 5.7% of a Qwen3.5-2B prefill's samples on a 2-core AMD EPYC with eight). Each panel meets
 * the chunk's rows XPASS at a time and the rest in one pass, so the codes unpacked once serve up to
 * XPASS rows of x. A row's result does not depend on the rows beside it.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qvec.h"

#define PANEL 16
#define QK 256
#define META 320
#define LOW 2048
#define XCHUNK 64
/* Rows of x per pass over a panel: unpacking a panel's codes once for 8 rows pays. On AVX2, a Q4_K
 * sub-block meets them 4 at a time (q4k_dots), and Q5_K's and Q6_K's runs go through qvec.h's dot4_rows. */
#define XPASS 8
/* At most this many rows in all meet a panel in one pass: on AVX-512, whose sub_block holds only the
 * rows' outputs across rows, a K = 4 verify's 5 rows in two parts (10) or a batch of 6 decodes (12),
 * whose codes passes of 8 and 2 (or 4) unpacked twice (docs/performance-notes.md, "The same Zen 5,
 * later"). More rows go XPASS at a time: passes of 10 or 12 made 512-row prefills slower. */
#ifdef __AVX512F__
#define ONE_PASS 12
#else
#define ONE_PASS XPASS
#endif
/* Software prefetch into L2 (as qmatmul.c, which says why) this far ahead in the first pass over a
 * panel, a few lines with each sub-block rather than a block's 37-53 at once: with both, 1-row
 * Q4_K streamed 16 -> 21 GB/s on the Intel AMX host (docs/performance-notes.md). */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif
#ifndef PREFETCH_HINT
#define PREFETCH_HINT _MM_HINT_T1
#endif
/* Below this many bytes of weights, one thread (waking the second costs more than it saves). */
#define PARALLEL_BYTES (64 << 10)

#define UNROLL _Pragma("GCC unroll 8")

/* Bytes of one panel's super-block. */
#define BLOCK_BYTES(kind) ((kind) == 4 ? META + LOW : (kind) == 5 ? META + LOW + 512 : META + LOW + 1024)

/* One span (32 values) of a row of x quantized: its int8 values, sx, xsum = sx * sum of q, and
 * init = -32 * sum of q over each 16 (Q6_K's offset). */
struct xspan {
    int8_t q[32];
    float sx, xsum;
    int32_t init[2];
};

/* x quantized: rows = parts * T, row parts*t + p; span g of row r at v[g * rows + r], so that a pass's
 * rows over one span lie side by side: one pointer and constant offsets reach each row's values and
 * scales. With the values, sx, xsum and init in four row-major arrays, each row of a pass took its
 * own address arithmetic in the inner loop (pointers spilled to the stack): on a 2-core AMD EPYC
 * (Zen 5), 512 rows through the llama-1b shape's 32 Q6_K MLP matrices took 737-755 ms against
 * 639-660 in this layout (benchmarks/kquant_rows.py --baseline, the same bits). */
struct kx {
    struct xspan *v;
    int64_t rows;
};

ALWAYS_INLINE const struct xspan *x_span(const struct kx *x, int64_t row, int64_t span) {
    return x->v + span * x->rows + row;
}

ALWAYS_INLINE int sum_i8x16(__m128i q) {
    __m128i s = sums_of_4(q);
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1))));
}

/* One span of 32 values -> its xspan. */
static void quantize_span(const float *x, struct xspan *out) {
    float amax = abs_max32(x);
    float s = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    __m128i qa = vf_to_i8x16(vf_mul(vf_loadu(x), vf_set1(inv)));
    __m128i qb = vf_to_i8x16(vf_mul(vf_loadu(x + 16), vf_set1(inv)));
    _mm_storeu_si128((__m128i *)out->q, qa);
    _mm_storeu_si128((__m128i *)(out->q + 16), qb);
    int sa = sum_i8x16(qa), sb = sum_i8x16(qb);
    out->sx = s;
    out->xsum = s * (float)(sa + sb);
    out->init[0] = -32 * sa;
    out->init[1] = -32 * sb;
}

/* r = x - s * q over one span: the first part's rounding error, for the second. */
static void residual(const float *x, const int8_t *q, float s, float *r) {
    for (int h = 0; h < 32; h += 16) {
        vf qh = i8x16_to_vf(_mm_loadu_si128((const __m128i *)(q + h)));
        vf_storeu(r + h, vf_sub(vf_loadu(x + h), vf_mul(vf_set1(s), qh)));
    }
}

/* In scratch from aligned_alloc (the caller frees x->v); 1 if out of memory. */
static int quantize_x(const float *x, int64_t T, int64_t K, int parts, int threads, struct kx *kx) {
    const int64_t rows = parts * T, spans = K / 32;
    kx->rows = rows;
    kx->v = aligned_alloc(64, (sizeof(struct xspan) * rows * spans + 63) / 64 * 64);
    if (!kx->v)
        return 1;
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && T >= 16)
    for (int64_t t = 0; t < T; t++)
        for (int64_t g = 0; g < spans; g++) {
            float r[32];
            const float *values = x + t * K + 32 * g;
            for (int p = 0; p < parts; p++) {
                const int64_t row = parts * t + p;
                if (p) {
                    const struct xspan *first = x_span(kx, row - 1, g);
                    residual(values, first->q, first->sx, r);
                    values = r;
                }
                quantize_span(values, kx->v + g * rows + row);
            }
        }
    return 0;
}

/* Vector g (0-7) of a sub-block's codes from the low-nibble vectors and the high-bit vectors. */
ALWAYS_INLINE vi codes_at(const vi *low, const vi *high, int g, const int kind) {
    const vi nib = vi_set1_i8(0x0F);
    vi c = g & 1 ? vi_and(vi_srli16(low[g >> 1], 4), nib) : vi_and(low[g >> 1], nib);
    if (kind == 5) {
        vi t = g <= 4 ? vi_slli32(high[0], 4 - g) : vi_srli32(high[0], g - 4);
        c = vi_or_and(c, t, vi_set1_i8(0x10));
    } else if (kind == 6) {
        const int j = g & 3;
        vi h = high[g >> 2];
        vi t = j <= 2 ? vi_slli32(h, 4 - 2 * j) : vi_srli32(h, 2);
        c = vi_or_and(c, t, vi_set1_i8(0x30));
    }
    return c;
}

ALWAYS_INLINE vf f16x16(const uint8_t *p) { return load_values(p, 0, 16, 1); }
ALWAYS_INLINE vf u8x16(const uint8_t *p) { return u8x16_minus_to_vf(_mm_loadu_si128((const __m128i *)p), 0); }
ALWAYS_INLINE vf i8x16(const uint8_t *p) { return i8x16_to_vf(_mm_loadu_si128((const __m128i *)p)); }

#include "kquant_dots.h"

/* out[rows r0 .. r0+R-1, panel's 16 columns] for one panel (`w`: its first block) and R rows of x;
 * `prefetch`: this pass is the panel's first, which streams it from memory. */
ALWAYS_INLINE void panel(const uint8_t *w, int64_t K, const struct kx *x, int64_t r0, const int R, float *out,
                         int64_t N, int64_t ldo, int64_t n0, const int kind, const int prefetch) {
    const int64_t blocks = K / QK;
    const int bytes = BLOCK_BYTES(kind), lines_per_sub = (bytes / 64 + 7) / 8;
    vf y[ONE_PASS];
    UNROLL for (int r = 0; r < R; r++)
        y[r] = vf_zero();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = w + b * bytes, *meta = blk, *lo = blk + META, *hi = blk + META + LOW;
        const vf d = f16x16(meta + 256);
        const vf neg_dmin = kind == 6 ? d : vf_sub(vf_zero(), f16x16(meta + 288));
        for (int s = 0; s < 8; s++) {
            if (PREFETCH_BYTES && prefetch) /* an eighth of the block's lines with each sub-block */
                for (int l = s * lines_per_sub; l < (s + 1) * lines_per_sub && l < bytes / 64; l++)
                    _mm_prefetch((const char *)blk + PREFETCH_BYTES + 64 * l, PREFETCH_HINT);
            vi low[4], high[2], c[8];
            for (int v = 0; v < 4; v++)
                low[v] = vi_loadu(lo + 256 * s + 64 * v);
            if (kind == 5)
                high[0] = vi_loadu(hi + 64 * s);
            if (kind == 6) {
                high[0] = vi_loadu(hi + 128 * s);
                high[1] = vi_loadu(hi + 128 * s + 64);
            }
            for (int g = 0; g < 8; g++)
                c[g] = codes_at(low, high, g, kind);
            sub_block(c, lo + 256 * s, meta, d, neg_dmin, s, x, r0, R, b * 8 + s, y, kind);
        }
    }
    UNROLL for (int r = 0; r < R; r++)
        vf_store_first(out + (r0 + r) * ldo + n0, y[r], N - n0 >= PANEL ? PANEL : (int)(N - n0));
}

/* Panel p against rows r0 .. r1-1 of x: up to ONE_PASS rows in one pass, more XPASS at a time and
 * the rest in one pass (a K = 4 verify's 5 rows once, where passes of 4 and 1 unpacked the codes
 * twice); the first pass prefetches. */
ALWAYS_INLINE void panel_rows(const uint8_t *w, int64_t K, const struct kx *x, int64_t r0, int64_t r1, float *out,
                              int64_t N, int64_t ldo, int64_t p, const int kind) {
    const uint8_t *wp = w + p * (K / QK) * BLOCK_BYTES(kind);
    int64_t r = r0;
    if (r1 - r0 > ONE_PASS)
        for (; r + XPASS <= r1; r += XPASS)
            panel(wp, K, x, r, XPASS, out, N, ldo, PANEL * p, kind, r == r0);
#define REST(n) case n: panel(wp, K, x, r, n, out, N, ldo, PANEL * p, kind, r == r0); break;
    switch (r1 - r) { /* a pass of constant rows, its sums in registers */
#if ONE_PASS > XPASS
    REST(12) REST(11) REST(10) REST(9)
#endif
    REST(8) REST(7) REST(6) REST(5) REST(4) REST(3) REST(2) REST(1)
    default: break;
    }
#undef REST
}

/* out[t] = y[2t] + y[2t+1] for rows of N (out's rows ldo apart). */
static void add_parts(const float *y, int64_t T, int64_t N, float *out, int64_t ldo) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t n = 0; n < N; n++)
            out[t * ldo + n] = y[2 * t * N + n] + y[(2 * t + 1) * N + n];
}

/* One exported kernel per kind, the parallel loop written out in each so that OpenMP's outlined
 * body is specialised for it (see qmatmul.c). 0, or 1 when scratch space cannot be allocated. */
#define KERNEL(name, kind)                                                                                    \
    int name(const float *x, int64_t T, int64_t K, const uint8_t *w, int64_t N, float *out, int64_t ldo,      \
             int32_t parts, int32_t num_threads) {                                                            \
        const int64_t panels = (N + PANEL - 1) / PANEL, rows = parts * T;                                     \
        const int64_t work = panels * (K / QK) * BLOCK_BYTES(kind) * (1 + rows / 4);                          \
        const int threads = num_threads > 1 && work >= PARALLEL_BYTES ? num_threads : 1;                      \
        struct kx kx;                                                                                         \
        if (quantize_x(x, T, K, parts, threads, &kx))                                                         \
            return 1;                                                                                         \
        float *y = parts == 1 ? out : malloc(sizeof(float) * rows * N);                                       \
        const int64_t ldy = parts == 1 ? ldo : N;                                                             \
        if (!y) {                                                                                             \
            free(kx.v);                                                                                       \
            return 1;                                                                                         \
        }                                                                                                     \
        _Pragma("omp parallel num_threads(threads) if (threads > 1)")                                         \
        for (int64_t r0 = 0; r0 < rows; r0 += XCHUNK) {                                                       \
            const int64_t r1 = r0 + XCHUNK < rows ? r0 + XCHUNK : rows;                                       \
            _Pragma("omp for schedule(static) nowait")                                                        \
            for (int64_t p = 0; p < panels; p++)                                                              \
                panel_rows(w, K, &kx, r0, r1, y, N, ldy, p, kind);                                            \
        }                                                                                                     \
        if (parts == 2) {                                                                                     \
            add_parts(y, T, N, out, ldo);                                                                     \
            free(y);                                                                                          \
        }                                                                                                     \
        free(kx.v);                                                                                           \
        return 0;                                                                                             \
    }                                                                                                         \
    int name##_call(const struct kq_args *a) {                                                                \
        return name(a->x, a->T, a->K, a->w, a->N, a->out, a->ldo, a->parts, a->num_threads);                  \
    }

/* One call's arguments as a struct, for a call list (kvgen/model/kernels/step.c). */
struct kq_args {
    const float *x;
    int64_t T, K;
    const uint8_t *w;
    int64_t N;
    float *out;
    int64_t ldo; /* out's row stride */
    int32_t parts, num_threads;
};

KERNEL(kq_matmul_q4_k, 4)
KERNEL(kq_matmul_q5_k, 5)
KERNEL(kq_matmul_q6_k, 6)

/* Row `row` of W^ into out [K] (an embedding lookup in a packed table): the file's values, as
 * kquant_format.dequantize computes them ((d*sc)*q and dmin*m are exact in fp32; one rounding). */
static void dequantize_row(const uint8_t *w, int64_t K, int64_t row, float *out, const int kind) {
    const int64_t blocks = K / QK;
    const int bytes = BLOCK_BYTES(kind), lane = (int)(row % PANEL);
    const uint8_t *panel_bytes = w + (row / PANEL) * blocks * bytes;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *meta = panel_bytes + b * bytes, *lo = meta + META, *hi = meta + META + LOW;
        uint16_t h;
        memcpy(&h, meta + 256 + 2 * lane, 2);
        const float d = _cvtsh_ss(h);
        memcpy(&h, meta + 288 + 2 * lane, 2);
        const float dmin = kind == 6 ? 0.0f : _cvtsh_ss(h);
        for (int col = 0; col < QK; col++) {
            const int s = col / 32, g = (col % 32) / 4, bb = col % 4;
            const uint8_t byte = lo[256 * s + 64 * (g / 2) + 4 * lane + bb];
            int q = g & 1 ? byte >> 4 : byte & 0x0F;
            uint32_t word;
            if (kind == 5) {
                memcpy(&word, hi + 64 * s + 4 * lane, 4);
                q |= (int)((word >> (8 * bb + g)) & 1) << 4;
            } else if (kind == 6) {
                memcpy(&word, hi + 128 * s + 64 * (g / 4) + 4 * lane, 4);
                q |= (int)((word >> (8 * bb + 2 * (g % 4))) & 3) << 4;
            }
            float value;
            if (kind == 6)
                value = (d * (float)(int8_t)meta[16 * (col / 16) + lane]) * (float)(q - 32);
            else
                value = (d * (float)meta[16 * s + lane]) * (float)q - dmin * (float)meta[128 + 16 * s + lane];
            out[b * QK + col] = value;
        }
    }
}

#define DEQUANTIZE_ROWS(name, kind)                                                                           \
    void name(const uint8_t *w, int64_t K, const int64_t *rows, int64_t n, float *out) {                      \
        for (int64_t i = 0; i < n; i++)                                                                       \
            dequantize_row(w, K, rows[i], out + i * K, kind);                                                 \
    }

DEQUANTIZE_ROWS(kq_rows_q4_k, 4)
DEQUANTIZE_ROWS(kq_rows_q5_k, 5)
DEQUANTIZE_ROWS(kq_rows_q6_k, 6)

/* Panel p's 16 rows of W^, each value dequantize_row's rounded to the nearest bf16 (ties to even),
 * into rows of K (out [16 * panels, K], the last panel's zero rows included): oneDNN's operand for
 * many rows of x. A value is s * (q - o) - m with s = d*sc, and m = dmin*m (Q4_K/Q5_K) or o = 32
 * (Q6_K), s * (q - o) exact: one fused multiply-add, one rounding, as dequantize_row. Quarter i of
 * an unpacked codes vector g is rows 4i .. 4i + 3's columns 4g .. 4g + 3. */
ALWAYS_INLINE void dequantize_panel_rows(const uint8_t *w, int64_t K, int64_t p, uint16_t *out, const int kind) {
    const int64_t blocks = K / QK;
    const int bytes = BLOCK_BYTES(kind), offset = kind == 6 ? 32 : 0;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *meta = w + (p * blocks + b) * bytes, *lo = meta + META, *hi = meta + META + LOW;
        const vf d = f16x16(meta + 256);
        const vf neg_dmin = kind == 6 ? vf_zero() : vf_sub(vf_zero(), f16x16(meta + 288));
        for (int s = 0; s < 8; s++) {
            vi low[4], high[2], c[8];
            for (int v = 0; v < 4; v++)
                low[v] = vi_loadu(lo + 256 * s + 64 * v);
            for (int h = 0; h < (kind == 6 ? 2 : kind == 5 ? 1 : 0); h++)
                high[h] = vi_loadu(hi + (kind == 6 ? 128 : 64) * s + 64 * h);
            for (int g = 0; g < 8; g++)
                c[g] = codes_at(low, high, g, kind);
            for (int half = 0; half < 2; half++) { /* columns 16 half .. 16 half + 15: Q6_K's scale groups */
                const vf sc = vf_mul(d, kind == 6 ? i8x16(meta + 32 * s + 16 * half) : u8x16(meta + 16 * s));
                const vf m = kind == 6 ? neg_dmin : vf_mul(neg_dmin, u8x16(meta + 128 + 16 * s));
                _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) { /* i: an immediate */
                    const vf si = spread(sc, 4 * i, 4), mi = spread(m, 4 * i, 4);
                    uint16_t *o = out + (PANEL * p + 4 * i) * K + b * QK + 32 * s;
                    for (int g = 4 * half; g < 4 * half + 4; g++)
                        store_quads(o + 4 * g, bf16_of(vf_fmadd(si, u8x16_minus_to_vf(row_codes(c[g], i), offset), mi)),
                                    K);
                }
            }
        }
    }
}

#define DEQUANTIZE_BF16(name, kind)                                                                           \
    void name(const uint8_t *w, int64_t K, int64_t N, uint16_t *out, int32_t num_threads) {                   \
        const int64_t panels = (N + PANEL - 1) / PANEL;                                                       \
        const int threads = num_threads > 1 && panels * BLOCK_BYTES(kind) * (K / QK) >= PARALLEL_BYTES ? num_threads : 1; \
        _Pragma("omp parallel for num_threads(threads) schedule(static) if (threads > 1)")                    \
        for (int64_t p = 0; p < panels; p++)                                                                  \
            dequantize_panel_rows(w, K, p, out, kind);                                                        \
    }

DEQUANTIZE_BF16(kq_dequantize_bf16_q4_k, 4)
DEQUANTIZE_BF16(kq_dequantize_bf16_q5_k, 5)
DEQUANTIZE_BF16(kq_dequantize_bf16_q6_k, 6)

/* x as the kernels quantize it (tests): q int8 [parts * T, K], sx fp32 [parts * T, K / 32]. */
int kq_quantize(const float *x, int64_t T, int64_t K, int32_t parts, int8_t *q, float *sx) {
    struct kx kx;
    if (quantize_x(x, T, K, parts, 1, &kx))
        return 1;
    for (int64_t row = 0; row < parts * T; row++)
        for (int64_t g = 0; g < K / 32; g++) {
            memcpy(q + row * K + 32 * g, x_span(&kx, row, g)->q, 32);
            sx[row * (K / 32) + g] = x_span(&kx, row, g)->sx;
        }
    free(kx.v);
    return 0;
}
