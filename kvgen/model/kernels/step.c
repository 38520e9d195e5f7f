/* The rest of a decode layer in C, and the loop that runs a whole step's kernel calls.
 *
 *     silu_mul     SwiGLU's silu(gate) * up, fp32 or bf16, for every row count: torch's two ops cost
 *                  ~6 us a decode layer for a microsecond of work
 *     gelu_mul     GeGLU's gelu_tanh(gate) * up (Gemma), the same way; gate and up are rows of one
 *                  gate_up matrix (an MLP) or of two (Gemma 4's per-layer input: its gate's output
 *                  and the layer's slice of the per-layer inputs)
 *     add          the residual add, x += y, fp32 or bf16
 *     scale        x *= s, by a scalar read from memory (Gemma 4's layer scalar), fp32 or bf16
 *     convert      rows between bf16 and fp32, for a bf16 model's decode attention
 *     run_calls    a list of kernel calls, each `int run(const void *args)` with its arguments bound
 *                  (a `_call` function of this folder's kernels, or of kvgen/model/kernels/qmatmul.c),
 *                  run in order: kvgen/model/fused.py makes a decode step's forward one such list,
 *                  so no Python runs between its ~330 calls; run_calls_call runs such a list as one
 *                  call of another list (layers side by side, kvgen/model/linear_choice.py)
 *
 * Built by kvgen/model/kernels/step.py like the paged decode kernel (the host's ISA, never AMX).
 * silu(g) = g / (1 + e^-g), each operation rounded once to fp32 as torch's op rounds it, with e^x
 * from exp16.h on AVX-512 and AVX2 (within an fp32 ulp of libm's expf, as torch's own vectorised exp
 * is; the same bits on both) and from expf elsewhere; bf16 rounds silu(g) to bf16, then the product,
 * as torch's two bf16 ops do. gelu_tanh(g) = g / 2 * (1 + tanh(sqrt(2 / pi) * (g + 0.044715 g^3))),
 * tanh(u) as 1 - 2 / (1 + e^2u) from the same exp: within a few fp32 ulp of torch's (which takes its
 * tanh from Sleef). Without a vector exp, libm's expf and tanhf took 13% of a Gemma 4 E2B prefill.
 */
#include <math.h>
#include <stdint.h>

#include "bf16_bits.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include "exp16.h"
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* The first `count` of 8 lanes (all where count >= 8), for AVX2's masked loads and stores. */
static inline __m256i lanes_below(int count) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0));
}
#endif

/* s[j] = silu(g[j]) for j < count (at most 16). */
static inline void silu16(const float *restrict g, int count, float *restrict s) {
#ifdef __AVX512F__
    const __mmask16 m = (__mmask16)((1u << count) - 1);
    const __m512 x = _mm512_maskz_loadu_ps(m, g);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
    _mm512_mask_storeu_ps(s, m, _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
#elif defined(__AVX2__) && defined(__FMA__)
    for (int h = 0; h < count; h += 8) {
        const __m256i m = lanes_below(count - h);
        const __m256 x = _mm256_maskload_ps(g + h, m);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
        _mm256_maskstore_ps(s + h, m, _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e)));
    }
#else
    for (int j = 0; j < count; j++)
        s[j] = g[j] / (1.f + expf(-g[j]));
#endif
}

#define GELU_C 0.7978845608028654f /* sqrt(2 / pi) */
#define GELU_A 0.044715f

/* s[j] = gelu_tanh(g[j]) for j < count (at most 16). */
static inline void gelu16(const float *restrict g, int count, float *restrict s) {
#ifdef __AVX512F__
    const __mmask16 m = (__mmask16)((1u << count) - 1);
    const __m512 x = _mm512_maskz_loadu_ps(m, g), one = _mm512_set1_ps(1.f);
    const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
    const __m512 u = _mm512_mul_ps(_mm512_set1_ps(GELU_C), _mm512_fmadd_ps(_mm512_set1_ps(GELU_A), cube, x));
    const __m512 e = exp16(_mm512_add_ps(u, u));
    const __m512 t = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(one, e)));
    _mm512_mask_storeu_ps(s, m, _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x), _mm512_add_ps(one, t)));
#elif defined(__AVX2__) && defined(__FMA__)
    for (int h = 0; h < count; h += 8) {
        const __m256i m = lanes_below(count - h);
        const __m256 x = _mm256_maskload_ps(g + h, m), one = _mm256_set1_ps(1.f);
        const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
        const __m256 u = _mm256_mul_ps(_mm256_set1_ps(GELU_C), _mm256_fmadd_ps(_mm256_set1_ps(GELU_A), cube, x));
        const __m256 e = exp8(_mm256_add_ps(u, u));
        const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(one, e)));
        _mm256_maskstore_ps(s + h, m, _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), _mm256_add_ps(one, t)));
    }
#else
    for (int j = 0; j < count; j++) {
        const float x = g[j], u = GELU_C * (x + GELU_A * x * x * x);
        s[j] = 0.5f * x * (1.f + tanhf(u));
    }
#endif
}

/* Prefill's hundreds of rows go to `num_threads` threads from this many elements. */
#define PARALLEL_ELEMENTS (1 << 16)

/* out [rows, n] = ACT(gate) * up, 16 at a time: gate's and up's rows `gate_stride` and `up_stride`
 * elements apart (an MLP's gate_up [rows, 2n]: both 2n, up = gate + n). */
#define GATE_MUL(NAME, ACT16)                                                                             \
    void NAME##_f32(const float *restrict gate, int64_t gate_stride, const float *restrict up,             \
                    int64_t up_stride, int64_t rows, int64_t n, float *restrict out, int32_t num_threads) { \
        const int parallel = num_threads > 1 && rows * n >= PARALLEL_ELEMENTS;                             \
        _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (parallel)")                \
        for (int64_t r = 0; r < rows; r++) {                                                               \
            const float *restrict g = gate + r * gate_stride, *restrict u = up + r * up_stride;             \
            float s[16];                                                                                   \
            for (int64_t i = 0; i < n; i += 16) {                                                          \
                const int count = n - i >= 16 ? 16 : (int)(n - i);                                         \
                ACT16(g + i, count, s);                                                                    \
                for (int j = 0; j < count; j++)                                                            \
                    out[r * n + i + j] = s[j] * u[i + j];                                                  \
            }                                                                                              \
        }                                                                                                  \
    }                                                                                                      \
                                                                                                           \
    void NAME##_bf16(const uint16_t *restrict gate, int64_t gate_stride, const uint16_t *restrict up,      \
                     int64_t up_stride, int64_t rows, int64_t n, uint16_t *restrict out,                   \
                     int32_t num_threads) {                                                                 \
        const int parallel = num_threads > 1 && rows * n >= PARALLEL_ELEMENTS;                             \
        _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (parallel)")                \
        for (int64_t r = 0; r < rows; r++) {                                                               \
            const uint16_t *restrict g = gate + r * gate_stride, *restrict u = up + r * up_stride;          \
            float wide[16], s[16];                                                                         \
            for (int64_t i = 0; i < n; i += 16) {                                                          \
                const int count = n - i >= 16 ? 16 : (int)(n - i);                                         \
                for (int j = 0; j < count; j++)                                                            \
                    wide[j] = from_bf16(g[i + j]);                                                         \
                ACT16(wide, count, s);                                                                     \
                for (int j = 0; j < count; j++)                                                            \
                    out[r * n + i + j] = to_bf16(from_bf16(to_bf16(s[j])) * from_bf16(u[i + j]));          \
            }                                                                                              \
        }                                                                                                  \
    }

GATE_MUL(silu_mul, silu16)
GATE_MUL(gelu_mul, gelu16)

/* -- call lists ----------------------------------------------------------------------------------- */

struct gate_mul_args {
    const void *gate;
    int64_t gate_stride;
    const void *up;
    int64_t up_stride, rows, n;
    void *out;
    int32_t num_threads;
};

#define GATE_MUL_CALL(NAME)                                                                               \
    int NAME##_call(const struct gate_mul_args *a) {                                                      \
        NAME(a->gate, a->gate_stride, a->up, a->up_stride, a->rows, a->n, a->out, a->num_threads);         \
        return 0;                                                                                         \
    }

GATE_MUL_CALL(silu_mul_f32)
GATE_MUL_CALL(silu_mul_bf16)
GATE_MUL_CALL(gelu_mul_f32)
GATE_MUL_CALL(gelu_mul_bf16)

/* x += y over n elements; bf16 rounds the fp32 sum once, as torch's add_ does. */
struct add_args {
    void *x;
    const void *y;
    int64_t n;
};

int add_f32_call(const struct add_args *a) {
    float *restrict x = a->x;
    const float *restrict y = a->y;
    for (int64_t i = 0; i < a->n; i++)
        x[i] += y[i];
    return 0;
}

int add_bf16_call(const struct add_args *a) {
    uint16_t *restrict x = a->x;
    const uint16_t *restrict y = a->y;
    for (int64_t i = 0; i < a->n; i++)
        x[i] = to_bf16(from_bf16(x[i]) + from_bf16(y[i]));
    return 0;
}

/* x *= *s over n elements, s of x's dtype; bf16 rounds the fp32 product once, as torch's mul_ does. */
struct scale_args {
    void *x;
    const void *s;
    int64_t n;
};

int scale_f32_call(const struct scale_args *a) {
    float *restrict x = a->x;
    const float s = *(const float *)a->s;
    for (int64_t i = 0; i < a->n; i++)
        x[i] *= s;
    return 0;
}

int scale_bf16_call(const struct scale_args *a) {
    uint16_t *restrict x = a->x;
    const float s = from_bf16(*(const uint16_t *)a->s);
    for (int64_t i = 0; i < a->n; i++)
        x[i] = to_bf16(from_bf16(x[i]) * s);
    return 0;
}

/* rows of n elements, `stride` elements apart in src, into contiguous dst: bf16 widened to fp32
 * (exact), or fp32 rounded to bf16 (nearest even, as torch's .to() rounds). A bf16 model's decode
 * attention reads fp32 queries and writes fp32 rows (kvgen.model.kernels.GroupDecode). */
struct convert_args {
    const void *src;
    int64_t rows, n, stride;
    void *dst;
};

#define CONVERT(NAME, SRC, DST, CONVERT_ONE)                                                            \
    int NAME(const struct convert_args *a) {                                                              \
        const SRC *src = a->src;                                                                          \
        DST *dst = a->dst;                                                                                \
        for (int64_t r = 0; r < a->rows; r++)                                                             \
            for (int64_t i = 0; i < a->n; i++)                                                            \
                dst[r * a->n + i] = CONVERT_ONE(src[r * a->stride + i]);                                  \
        return 0;                                                                                         \
    }

CONVERT(bf16_to_f32_call, uint16_t, float, from_bf16)
CONVERT(f32_to_bf16_call, float, uint16_t, to_bf16)

struct call {
    int (*run)(const void *args);
    const void *args;
};

/* Runs calls[0 .. count-1] in order; stops at the first that fails (out of memory) and returns its
 * index + 1, else 0. */
int64_t run_calls(const struct call *calls, int64_t count) {
    for (int64_t i = 0; i < count; i++)
        if (calls[i].run(calls[i].args))
            return i + 1;
    return 0;
}

/* A list of calls as one call (layers side by side, each writing its columns of one output). */
struct call_list_args {
    const struct call *calls;
    int64_t count;
};

int run_calls_call(const struct call_list_args *a) { return run_calls(a->calls, a->count) != 0; }
