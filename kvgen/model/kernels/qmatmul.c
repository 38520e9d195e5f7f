/* y = x @ W^T for weights kept quantized: integer dot products (AVX-512 VNNI, or AVX2), as ggml does.
 *
 * Built by kvgen/model/kernels/qmatmul.py with explicit flags (AVX-512 F/BW/VL/VNNI, FMA, F16C; or AVX2,
 * FMA, F16C; never -march=native, never AMX) and called through ctypes, only on CPUs that report
 * those features. qvec.h holds the two builds' vectors; the code below is written once for both.
 *
 * Weights [N, K] (layout in kvgen/model/formats/packed.py): unsigned codes u, an integer offset o,
 * and per group of G (32, or 16 for 8-bit) a scale s and an optional min m: w = s * (u - o) + m.
 * 4-bit codes may index a codebook (`book`: MXFP4's, qvec.h's E2M1_CODES), looked up as they unpack.
 * Rows come in panels of 16, stored span (32 columns) by span; unpacked, a span is 8 vectors c_g,
 * lane n holding columns 4g .. 4g + 3 of row n (4-bit codes: the low and high nibbles of 4 loads).
 *
 * Each row of x is quantized once per call to int8 per span (as ggml's q8_0 activations):
 * sx = max|x| / 127, qx = round(x / sx), so x^ = sx * qx. Then per group, exactly in int32 and in
 * each row's own lane,
 *     dot = sum (u - o) * qx = -o * sum qx + sum over g of vpdpbusd(c_g, qx[4g .. 4g + 3] broadcast)
 * and in fp32, per span (two groups a span for G = 16, the first's sum going into the second's)
 *     t = s * dot (+ m * sum qx),   y += t * sx
 * the exact dot product of the dequantized W with x^, up to fp32 rounding of the products and the
 * sums (a chain of K/32 additions per output; tests/model/quant/bounds.py). With parts = 2, x's
 * rounding error r = x - x^ is quantized the same way as a second row of x (its step is ~1/254 of
 * the first's) and the two rows' results are added: one more row of x per token, the weights still
 * read once.
 *
 * Work: rows of x in chunks of XCHUNK (their int8 copy stays in L2); per chunk, OpenMP over panels,
 * and each panel meets the chunk's rows 8 at a time and the rest in one pass, so the codes unpacked
 * once serve up to 8 rows of x: a verify chunk of 7 tokens (14 rows in two parts) costs little more
 * than one token's read of the weights. Every output goes through the same operations whatever the
 * number of rows, so a row's result does not depend on the rows beside it.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qvec.h"

#define PANEL 16  /* weight rows per panel: the int32 lanes of a vector */
/* Rows of x per pass over a panel: as many as qvec.h's dot4_rows takes at once (8; on AVX2, whose 16
 * ymm hold 4 rows' sums, 4: 8 a pass there, in two calls, took 12-30% longer at 4 to 64 rows). */
#define XPASS DOT4_ROWS
#define XCHUNK 64 /* rows of x per chunk */
#define UNROLL _Pragma("GCC unroll 8")
/* The tunables below were chosen by A/B microbenchmarks (BENCHMARKS.md); -D overrides them. */
/* Software prefetch distance along a thread's stream of codes, in the first pass over a panel (the
 * one that streams it from memory; later passes find it in L1/L2): the hardware prefetchers stop
 * at each 4 KiB page, and a layer's weights are a few hundred KiB read once per step. */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 2048
#endif
/* Into L2, not L1: a prefetch into L1 holds one of its few fill buffers until the line arrives, and
 * those are what the demand loads need, so the stream and the arithmetic overlapped less (1-row
 * decode on the Intel AMX host: 1B Q8_0 15 -> 17 tok/s; kquant.c the same, docs/performance-notes.md). */
#ifndef PREFETCH_HINT
#define PREFETCH_HINT _MM_HINT_T1
#endif
/* Below this many bytes of weights (plus a share for each row of x), one thread: waking the second
 * costs more than it saves. Since OpenMP's workers spin briefly after each call (kvgen/threads.py),
 * a decode step's calls find the second thread awake: from 64 KiB on two threads read SmolLM2's
 * 200-550 KiB layers 1.3-1.7x faster than one. */
#ifndef PARALLEL_BYTES
#define PARALLEL_BYTES (64 << 10)
#endif

/* Every packed format, listed once for the kernels and the dequantizers: the functions' name, bits of a
 * code, group, fp16 scales, codebook. */
#define FORMATS(X)                                                                                            \
    X(qmatmul_u4_g32_f16, 4, 32, 1, 0)                                                                        \
    X(qmatmul_u4_g32_f32, 4, 32, 0, 0)                                                                        \
    X(qmatmul_u8_g32_f16, 8, 32, 1, 0)                                                                        \
    X(qmatmul_u8_g32_f32, 8, 32, 0, 0)                                                                        \
    X(qmatmul_u8_g16_f32, 8, 16, 0, 0)                                                                        \
    X(qmatmul_e2m1_g32_f16, 4, 32, 1, 1)                                                                      \
    X(qmatmul_e2m1_g32_f32, 4, 32, 0, 1)

/* x after quantization (rows = parts * T, row parts * t + p), span by span: a pass's rows of one
 * span lie together, each a fixed offset from one pointer. */
struct xq {
    int64_t rows;
    int8_t *q;     /* [K / 32, rows, 32] */
    float *sx;     /* [K / 32, rows] */
    float *qsum;   /* [K / G, rows]: sum of q over the group, exactly */
    int32_t *init; /* [K / G, rows]: -o * sum of q over the group (vpdpbusd's start value) */
};

/* The sum of 4 int32 lanes. */
static inline int lane_total(__m128i v) {
    v = _mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(_mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 3, 0, 1))));
}

/* One span of x -> q, sx, and per group (`stride` apart) qsum and init. */
static void quantize_span(const float *x, int32_t offset, int group, int8_t *q, float *sx, float *qsum,
                          int32_t *init, int64_t stride) {
    float amax = abs_max32(x);
    float s = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    __m128i qa = vf_to_i8x16(vf_mul(vf_loadu(x), vf_set1(inv)));
    __m128i qb = vf_to_i8x16(vf_mul(vf_loadu(x + 16), vf_set1(inv)));
    _mm_storeu_si128((__m128i *)q, qa);
    _mm_storeu_si128((__m128i *)(q + 16), qb);
    *sx = s;
    int total_a = lane_total(sums_of_4(qa)), total_b = lane_total(sums_of_4(qb));
    if (group == 32) {
        qsum[0] = (float)(total_a + total_b);
        init[0] = -offset * (total_a + total_b);
    } else {
        qsum[0] = (float)total_a;
        qsum[stride] = (float)total_b;
        init[0] = -offset * total_a;
        init[stride] = -offset * total_b;
    }
}

/* Bytes 4g .. 4g + 3 of a span of x, as one int32. */
ALWAYS_INLINE int32_t x4(const int8_t *q, int g) {
    int32_t v;
    memcpy(&v, q + 4 * g, 4);
    return v;
}

/* a[r] += sum over g in [g0, g1) of codes c[g] by row r's 4 bytes g of x (row r's span at
 * xq + 32 r), the rows' chains of dependent vpdpbusd interleaved to hide its latency (at R <= 2,
 * two chains a row). AVX2 adds 4-bit codes' products in int16 a run at a time (dot4_rows): 8 vectors
 * of codes up to 15, or 4 of the codebook's up to 24, stay below 32,768. Integer sums: the same
 * whatever the order. */
ALWAYS_INLINE void dots(const vi *c, const int8_t *xq, const int g0, const int g1, const int R, vi *a,
                        const int bits, const int book) {
#ifndef __AVX512F__
    if (bits == 4) {
        const int run = book ? 4 : 8;
        UNROLL for (int g = g0; g < g1; g += run) {
            const int32_t *x[XPASS];
            UNROLL for (int r = 0; r < R; r++)
                x[r] = (const int32_t *)(xq + 32 * r) + g;
            dot4_rows(a, c + g, x, run, R);
        }
        return;
    }
#endif
    if (R <= 2) {
        vi b[2];
        UNROLL for (int r = 0; r < R; r++)
            b[r] = vi_set1_i32(0);
        UNROLL for (int g = g0; g < g1; g += 2)
            UNROLL for (int r = 0; r < R; r++) {
                a[r] = dot4(a[r], c[g], vi_set1_i32(x4(xq + 32 * r, g)), bits);
                b[r] = dot4(b[r], c[g + 1], vi_set1_i32(x4(xq + 32 * r, g + 1)), bits);
            }
        UNROLL for (int r = 0; r < R; r++)
            a[r] = vi_add(a[r], b[r]);
    } else {
        UNROLL for (int g = g0; g < g1; g++)
            UNROLL for (int r = 0; r < R; r++)
                a[r] = dot4(a[r], c[g], vi_set1_i32(x4(xq + 32 * r, g)), bits);
    }
}

/* The 8 vectors of one panel's span of codes (4-bit: the nibbles of 4 loads; 8-bit: 8 loads). */
ALWAYS_INLINE void span_codes(const uint8_t *p, const int bits, const int book, vi *c) {
    UNROLL for (int v = 0; v < 4; v++)
        load_codes(p + v * PANEL * bits, bits, book, &c[2 * v], &c[2 * v + 1]);
}

/* out[rows r0 .. r0+R-1, panel p's 16 columns]; `prefetch`: this pass is the panel's first, which
 * streams it from memory. */
ALWAYS_INLINE void panel(const struct xq *x, int64_t r0, const int R, int64_t K, const uint8_t *codes,
                         const void *scale, const void *min, int64_t p, int64_t N, float *out, const int bits,
                         const int group, const int f16, const int book, const int prefetch) {
    const int64_t spans = K / 32, groups = K / group;
    const int per_span = 32 / group, span_bytes = PANEL * 4 * bits, value_bytes = f16 ? 2 : 4;
    const uint8_t *wc = codes + p * spans * span_bytes;
    const int64_t wv = p * groups * PANEL; /* the panel's first scale / min */
    vf y[XPASS];
    UNROLL for (int r = 0; r < R; r++)
        y[r] = vf_zero();
    for (int64_t j = 0; j < spans; j++) {
        const uint8_t *pc = wc + j * span_bytes;
        if (PREFETCH_BYTES && prefetch) {
            const int64_t ahead = wv + (j + PREFETCH_BYTES / span_bytes) * per_span * PANEL; /* scales of a span ahead */
            for (int l = 0; l < span_bytes; l += 64)
                _mm_prefetch((const char *)pc + PREFETCH_BYTES + l, PREFETCH_HINT);
            for (int l = 0; l < per_span * PANEL * value_bytes; l += 64) {
                _mm_prefetch((const char *)scale + ahead * value_bytes + l, PREFETCH_HINT);
                if (min)
                    _mm_prefetch((const char *)min + ahead * value_bytes + l, PREFETCH_HINT);
            }
        }
        vi c[8];
        span_codes(pc, bits, book, c);
        const int8_t *xq = x->q + (j * x->rows + r0) * 32;
        vf t[XPASS]; /* the span's s * dot (+ m * sum qx), over its groups */
        UNROLL for (int r = 0; r < R; r++)
            t[r] = vf_zero();
        for (int h = 0; h < per_span; h++) {
            const int64_t g = j * per_span + h, at = wv + g * PANEL;
            const vf sw = load_values(scale, at, PANEL, f16);
            vi a[XPASS];
            UNROLL for (int r = 0; r < R; r++)
                a[r] = vi_set1_i32(x->init[g * x->rows + r0 + r]);
            dots(c, xq, 8 / per_span * h, 8 / per_span * (h + 1), R, a, bits, book);
            const vf mw = min ? load_values(min, at, PANEL, f16) : vf_zero();
            UNROLL for (int r = 0; r < R; r++) {
                const vf qsum = vf_set1(x->qsum[g * x->rows + r0 + r]);
                const vf base = min ? (h ? vf_fmadd(mw, qsum, t[r]) : vf_mul(mw, qsum)) : t[r];
                t[r] = h || min ? vf_fmadd(sw, vi_to_vf(a[r]), base) : vf_mul(sw, vi_to_vf(a[r]));
            }
        }
        UNROLL for (int r = 0; r < R; r++)
            y[r] = vf_fmadd(t[r], vf_set1(x->sx[j * x->rows + r0 + r]), y[r]);
    }
    const int rows = N - PANEL * p >= PANEL ? PANEL : (int)(N - PANEL * p); /* the last panel may be padding */
    UNROLL for (int r = 0; r < R; r++)
        vf_store_first(out + (r0 + r) * N + PANEL * p, y[r], rows);
}

/* Panel p against rows r0 .. r1-1 of x: XPASS at a time, then the rest in one pass of constant rows (as
 * kquant.c: passes of 4, 2 and 1 unpacked the codes again); the first pass prefetches. */
ALWAYS_INLINE void panel_rows(const struct xq *x, int64_t r0, int64_t r1, int64_t K, const uint8_t *codes,
                              const void *scale, const void *min, int64_t p, int64_t N, float *out,
                              const int bits, const int group, const int f16, const int book) {
    int64_t r = r0;
    for (; r + XPASS <= r1; r += XPASS)
        panel(x, r, XPASS, K, codes, scale, min, p, N, out, bits, group, f16, book, r == r0);
#define REST(n) case n: panel(x, r, n, K, codes, scale, min, p, N, out, bits, group, f16, book, r == r0); break;
    switch (r1 - r) {
#if XPASS == 8
    REST(7) REST(6) REST(5) REST(4)
#endif
    REST(3) REST(2) REST(1)
    default: break;
    }
#undef REST
}

/* r = x - s * q over one span: the rounding error of the first part, for the second. */
static void residual(const float *x, const int8_t *q, float s, float *r) {
    for (int h = 0; h < 32; h += 16) {
        vf q_h = i8x16_to_vf(_mm_loadu_si128((const __m128i *)(q + h)));
        vf_storeu(r + h, vf_sub(vf_loadu(x + h), vf_mul(vf_set1(s), q_h)));
    }
}

/* Row t of x as `parts` rows of quantized x (rows parts*t ..): the first quantizes x, the second
 * (parts = 2) x's rounding error after the first, so that x is within half the second's much finer
 * step. In scratch space from aligned_alloc (the caller frees xq->q); 1 if out of memory. */
static int quantize_x(const float *x, int64_t T, int64_t K, int32_t offset, int group, int parts, int threads,
                      struct xq *xq) {
    const int64_t spans = K / 32, groups = K / group, rows = parts * T;
    size_t bytes = (size_t)(rows * (K + spans * 4 + groups * 8));
    char *scratch = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!scratch)
        return 1;
    xq->rows = rows;
    xq->q = (int8_t *)scratch;
    xq->sx = (float *)(scratch + rows * K);
    xq->qsum = xq->sx + rows * spans;
    xq->init = (int32_t *)(xq->qsum + rows * groups);
    const int per_span = 32 / group;
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && T >= 16)
    for (int64_t t = 0; t < T; t++)
        for (int64_t j = 0; j < spans; j++) {
            float r[32];
            const float *values = x + t * K + 32 * j;
            for (int part = 0; part < parts; part++) {
                const int64_t row = parts * t + part;
                if (part) {
                    residual(values, xq->q + (j * rows + row - 1) * 32, xq->sx[j * rows + row - 1], r);
                    values = r;
                }
                const int64_t g = per_span * j * rows + row; /* the span's first group */
                quantize_span(values, offset, group, xq->q + (j * rows + row) * 32, xq->sx + j * rows + row,
                              xq->qsum + g, xq->init + g, rows);
            }
        }
    return 0;
}

/* out[t] = parts[2t] + parts[2t+1] for rows of N. */
static void add_parts(const float *parts, int64_t T, int64_t N, float *out) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t n = 0; n < N; n++)
            out[t * N + n] = parts[2 * t * N + n] + parts[(2 * t + 1) * N + n];
}

/* One exported kernel per format. The parallel loop is written out in each, so that OpenMP's
 * outlined body is specialised for the format's constants (inside a shared inline function it is
 * outlined once, with bits/group/f16 as run-time values, and runs about three times slower).
 * Returns 0, or 1 when the scratch space for x cannot be allocated. */
#define KERNEL(name, bits, group, f16, book)                                                                  \
    int name(const float *x, int64_t T, int64_t K, const uint8_t *codes, const void *scale, const void *min,  \
             int32_t offset, int64_t N, float *out, int32_t parts, int32_t num_threads) {                     \
        const int64_t panels = (N + PANEL - 1) / PANEL, rows = parts * T;                                     \
        const int64_t work = panels * PANEL * K * bits / 8 * (1 + rows / 4);                                  \
        const int threads = num_threads > 1 && work >= PARALLEL_BYTES ? num_threads : 1;                      \
        struct xq xq;                                                                                         \
        if (quantize_x(x, T, K, offset - CODE_BIAS(bits), group, parts, threads, &xq))                        \
            return 1;                                                                                         \
        float *y = parts == 1 ? out : malloc(sizeof(float) * rows * N);                                       \
        if (!y) {                                                                                             \
            free(xq.q);                                                                                       \
            return 1;                                                                                         \
        }                                                                                                     \
        for (int64_t r0 = 0; r0 < rows; r0 += XCHUNK) {                                                       \
            const int64_t r1 = r0 + XCHUNK < rows ? r0 + XCHUNK : rows;                                       \
            if (threads == 1) { /* no parallel region at all: entering even a serial one costs time */       \
                for (int64_t p = 0; p < panels; p++)                                                          \
                    panel_rows(&xq, r0, r1, K, codes, scale, min, p, N, y, bits, group, f16, book);           \
            } else {                                                                                          \
                _Pragma("omp parallel for num_threads(threads) schedule(static)")                             \
                for (int64_t p = 0; p < panels; p++)                                                          \
                    panel_rows(&xq, r0, r1, K, codes, scale, min, p, N, y, bits, group, f16, book);           \
            }                                                                                                 \
        }                                                                                                     \
        if (parts == 2) {                                                                                     \
            add_parts(y, T, N, out);                                                                          \
            free(y);                                                                                          \
        }                                                                                                     \
        free(xq.q);                                                                                           \
        return 0;                                                                                             \
    }

/* One call's arguments as a struct, for a call list (kvgen/model/kernels/step.c): `name`_call. */
struct qmatmul_args {
    const float *x;
    int64_t T, K;
    const uint8_t *codes;
    const void *scale, *min;
    int32_t offset;
    int64_t N;
    float *out;
    int32_t parts, num_threads;
};

#define KERNELS(name, bits, group, f16, book)                                                                 \
    KERNEL(name, bits, group, f16, book)                                                                      \
    int name##_call(const struct qmatmul_args *a) {                                                           \
        return name(a->x, a->T, a->K, a->codes, a->scale, a->min, a->offset, a->N, a->out, a->parts,          \
                    a->num_threads);                                                                          \
    }

FORMATS(KERNELS)

/* -- dequantizing, for many rows of x --------------------------------------------------------------
 * At prefill's hundreds of rows the integer kernel is compute-bound, and two parts of x cost it twice
 * the work. There W^ is dequantized once per call and x runs through a float kernel
 * (kvgen/model/linear.py): in bf16 (bf16_matmul.c's layout) or in fp32 (f32_matmul.c's). Each
 * value is w = s * (u - o) + m, one fp32 fused multiply-add ((u - o) and s * (u - o) are exact). */

/* Panel p of W^, rounded to the nearest bf16 (ties to even), into bf16_matmul.c's layout
 * [ceil(N / 4), spans, 4, 32] (tiles of 4 rows, span by span; quarter q of the panel is tile 4p + q),
 * or with `row_major` into rows of K [16 * panels, K] (oneDNN's operand; the last panel's padding
 * rows included). Quarter q of a codes vector holds columns 4g .. 4g + 3 of those 4 rows (lane
 * 4i + b: row i, column 4g + b), so with the rows' scales and mins spread over their 4 lanes each
 * row's 4 values come out together. */
ALWAYS_INLINE void dequantize_panel_bf16(const uint8_t *codes, const void *scale, const void *min, int32_t offset,
                                         int64_t p, int64_t N, int64_t K, uint16_t *out, const int bits,
                                         const int group, const int f16, const int book, const int row_major) {
    const int64_t spans = K / 32, groups = K / group, tiles = (N + 3) / 4;
    const int per_span = 32 / group, quarters = row_major || tiles - 4 * p >= 4 ? 4 : (int)(tiles - 4 * p);
    for (int64_t j = 0; j < spans; j++) {
        vi c[8];
        span_codes(codes + (p * spans + j) * PANEL * 4 * bits, bits, book, c);
        for (int h = 0; h < per_span; h++) {
            const int64_t at = (p * groups + j * per_span + h) * PANEL;
            const vf sw = load_values(scale, at, PANEL, f16), mw = min ? load_values(min, at, PANEL, f16) : vf_zero();
            _Pragma("GCC unroll 4") for (int q = 0; q < 4 && q < quarters; q++) { /* q: an immediate */
                const vf s = spread(sw, 4 * q, 4), m = spread(mw, 4 * q, 4);
                uint16_t *o = row_major ? out + (PANEL * p + 4 * q) * K + 32 * j : out + ((4 * p + q) * spans + j) * 128;
                for (int g = 8 / per_span * h; g < 8 / per_span * (h + 1); g++)
                    store_quads(o + 4 * g, bf16_of(vf_fmadd(s, u8x16_minus_to_vf(row_codes(c[g], q), offset), m)),
                                row_major ? K : 32);
            }
        }
    }
}
ALWAYS_INLINE void dequantize_panel_bf16_tiles(const uint8_t *codes, const void *scale, const void *min,
                                               int32_t offset, int64_t p, int64_t N, int64_t K, uint16_t *out,
                                               const int bits, const int group, const int f16, const int book) {
    dequantize_panel_bf16(codes, scale, min, offset, p, N, K, out, bits, group, f16, book, 0);
}
ALWAYS_INLINE void dequantize_panel_bf16_rows(const uint8_t *codes, const void *scale, const void *min,
                                              int32_t offset, int64_t p, int64_t N, int64_t K, uint16_t *out,
                                              const int bits, const int group, const int f16, const int book) {
    dequantize_panel_bf16(codes, scale, min, offset, p, N, K, out, bits, group, f16, book, 1);
}

/* Rows 32P .. 32P + 31 of W^ into f32_matmul.c's panel P [K, 32] (zeros past N): codes panels 2P
 * and 2P + 1, whose column 4g + b is byte b of vector g's 16 lanes. */
ALWAYS_INLINE void dequantize_panel_f32(const uint8_t *codes, const void *scale, const void *min, int32_t offset,
                                        int64_t P, int64_t N, int64_t K, float *out, const int bits,
                                        const int group, const int f16, const int book) {
    const int64_t spans = K / 32, groups = K / group;
    const int per_span = 32 / group;
    for (int half = 0; half < 2; half++) {
        const int64_t p = 2 * P + half;
        float *o = out + P * K * 32 + PANEL * half;
        if (p * PANEL >= N) { /* past the last panel of codes */
            for (int64_t col = 0; col < K; col++)
                memset(o + col * 32, 0, sizeof(float) * PANEL);
            continue;
        }
        for (int64_t j = 0; j < spans; j++) {
            vi c[8];
            span_codes(codes + (p * spans + j) * PANEL * 4 * bits, bits, book, c);
            for (int h = 0; h < per_span; h++) {
                const int64_t at = (p * groups + j * per_span + h) * PANEL;
                const vf sw = load_values(scale, at, PANEL, f16);
                const vf mw = min ? load_values(min, at, PANEL, f16) : vf_zero();
                for (int g = 8 / per_span * h; g < 8 / per_span * (h + 1); g++)
                    for (int b = 0; b < 4; b++)
                        vf_storeu(o + (32 * j + 4 * g + b) * 32, vf_fmadd(sw, byte_minus_to_vf(c[g], b, offset), mw));
            }
        }
    }
}

/* One exported function per format and layout, as for the kernels (OpenMP's outlined body per
 * format): over panels of 16 rows (bf16 tiles or rows) or 32 (fp32). */
#define DEQUANTIZE(name, bits, group, f16, book, type, rows, panel_fn)                                        \
    void name(const uint8_t *codes, const void *scale, const void *min, int32_t offset, int64_t N, int64_t K,  \
              type *out, int32_t num_threads) {                                                               \
        const int64_t panels = (N + (rows) - 1) / (rows);                                                     \
        const int threads = num_threads > 1 && N * K * bits / 8 >= PARALLEL_BYTES ? num_threads : 1;          \
        _Pragma("omp parallel for num_threads(threads) schedule(static) if (threads > 1)")                    \
        for (int64_t p = 0; p < panels; p++)                                                                  \
            panel_fn(codes, scale, min, offset, p, N, K, out, bits, group, f16, book);                        \
    }
#define DEQUANTIZERS(name, bits, group, f16, book)                                                            \
    DEQUANTIZE(name##_bf16, bits, group, f16, book, uint16_t, PANEL, dequantize_panel_bf16_tiles)             \
    DEQUANTIZE(name##_bf16_rows, bits, group, f16, book, uint16_t, PANEL, dequantize_panel_bf16_rows)         \
    DEQUANTIZE(name##_f32, bits, group, f16, book, float, 2 * PANEL, dequantize_panel_f32)

FORMATS(DEQUANTIZERS)

/* x as the kernels quantize it, `parts` rows per row of x: x^ = sum over parts of scale * q (tests). */
int quantize_activations(const float *x, int64_t T, int64_t K, int32_t parts, int8_t *q, float *scale) {
    struct xq xq;
    if (quantize_x(x, T, K, 0, 32, parts, 1, &xq))
        return 1;
    const int64_t spans = K / 32;
    for (int64_t row = 0; row < parts * T; row++)
        for (int64_t j = 0; j < spans; j++) {
            memcpy(q + row * K + 32 * j, xq.q + (j * xq.rows + row) * 32, 32);
            scale[row * spans + j] = xq.sx[j * xq.rows + row];
        }
    free(xq.q);
    return 0;
}
