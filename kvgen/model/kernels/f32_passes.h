/* The passes of kvgen's fp32 kernels over panels of 32 output features (f32_matmul.c, and
 * f32_coded.c on decoded panels), shared by both builds of f32_matmul.c: see its header.
 */
#include <immintrin.h>
#include <stdint.h>

#define PANEL 32
/* Software prefetch into L2, this far ahead in the panel's stream (both lines of a k step). */
#define PREFETCH_L2 (16 << 10)
/* Below this much work (the weights' bytes, and a share more per pass of MAX_ROWS rows of x), one
 * thread: the second's share would cost more to hand over than it saves. */
#define PARALLEL_BYTES (256 << 10)

/* One pass of R rows of x (row t at x + t * K) over a panel, into y (row t at y + t * N); `left`
 * says how many of the panel's 32 outputs exist (fewer in the last panel of an N that is no
 * multiple of 32). The accumulators are named variables, not an array: gcc keeps an array of
 * vectors on the stack. AVX-512 keeps a row's 32 outputs in 2 zmm, AVX2 (the build for CPUs
 * without AVX-512, kernels/f32.py) in 4 ymm: the same fused multiply-adds in the same order, so
 * the same bits. */
#ifdef __AVX512F__
#define MAX_ROWS 14 /* 28 accumulators of the 32 vector registers */
#define ACC(t) __m512 lo##t = _mm512_setzero_ps(), hi##t = _mm512_setzero_ps();
#define LOAD_PANEL const __m512 w_lo = _mm512_loadu_ps(panel), w_hi = _mm512_loadu_ps(panel + 16);
#define FMA(t)                                                                                            \
    {                                                                                                     \
        const __m512 xt = _mm512_set1_ps(x[(t) * K + k]);                                                 \
        lo##t = _mm512_fmadd_ps(xt, w_lo, lo##t);                                                         \
        hi##t = _mm512_fmadd_ps(xt, w_hi, hi##t);                                                         \
    }
#define MASKS                                                                                             \
    const __mmask16 first = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);              \
    const __mmask16 second = left >= 32 ? (__mmask16)0xFFFF : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1u);
#define STORE(t)                                                                                          \
    _mm512_mask_storeu_ps(y + (t) * N, first, lo##t);                                                     \
    _mm512_mask_storeu_ps(y + (t) * N + 16, second, hi##t);
#else
#define MAX_ROWS 3 /* 12 accumulators and 3 broadcasts of the 16 vector registers (the weights are operands) */
#define ACC(t) __m256 a##t##0 = _mm256_setzero_ps(), a##t##1 = a##t##0, a##t##2 = a##t##0, a##t##3 = a##t##0;
#define LOAD_PANEL
#define FMA(t)                                                                                            \
    {                                                                                                     \
        const __m256 xt = _mm256_set1_ps(x[(t) * K + k]);                                                 \
        a##t##0 = _mm256_fmadd_ps(xt, _mm256_loadu_ps(panel), a##t##0);                                   \
        a##t##1 = _mm256_fmadd_ps(xt, _mm256_loadu_ps(panel + 8), a##t##1);                               \
        a##t##2 = _mm256_fmadd_ps(xt, _mm256_loadu_ps(panel + 16), a##t##2);                              \
        a##t##3 = _mm256_fmadd_ps(xt, _mm256_loadu_ps(panel + 24), a##t##3);                              \
    }
/* lanes_j: which of outputs 8j .. 8j + 7 exist */
#define MASKS                                                                                             \
    const __m256i lane = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);                                        \
    const __m256i lanes_0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(left), lane);                           \
    const __m256i lanes_1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(left - 8), lane);                       \
    const __m256i lanes_2 = _mm256_cmpgt_epi32(_mm256_set1_epi32(left - 16), lane);                      \
    const __m256i lanes_3 = _mm256_cmpgt_epi32(_mm256_set1_epi32(left - 24), lane);
#define STORE(t)                                                                                          \
    _mm256_maskstore_ps(y + (t) * N, lanes_0, a##t##0);                                                   \
    _mm256_maskstore_ps(y + (t) * N + 8, lanes_1, a##t##1);                                               \
    _mm256_maskstore_ps(y + (t) * N + 16, lanes_2, a##t##2);                                              \
    _mm256_maskstore_ps(y + (t) * N + 24, lanes_3, a##t##3);
#endif
#define PASS(R)                                                                                           \
    static void pass_x##R(const float *x, int64_t K, const float *panel, float *y, int64_t N, int64_t left) { \
        UP_TO_##R(ACC)                                                                                    \
        for (int64_t k = 0; k < K; k++, panel += PANEL) {                                                 \
            _mm_prefetch((const char *)panel + PREFETCH_L2, _MM_HINT_T1);                                 \
            _mm_prefetch((const char *)panel + PREFETCH_L2 + 64, _MM_HINT_T1);                            \
            LOAD_PANEL                                                                                    \
            UP_TO_##R(FMA)                                                                                \
        }                                                                                                 \
        MASKS                                                                                             \
        UP_TO_##R(STORE)                                                                                  \
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
PASS(1) PASS(2) PASS(3)
#ifdef __AVX512F__
PASS(4) PASS(5) PASS(6) PASS(7) PASS(8) PASS(9) PASS(10) PASS(11) PASS(12) PASS(13) PASS(14)
#endif

typedef void (*pass_fn)(const float *, int64_t, const float *, float *, int64_t, int64_t);
static const pass_fn PASSES[MAX_ROWS + 1] = {0, pass_x1, pass_x2, pass_x3,
#ifdef __AVX512F__
                                             pass_x4, pass_x5, pass_x6, pass_x7, pass_x8, pass_x9, pass_x10,
                                             pass_x11, pass_x12, pass_x13, pass_x14
#endif
};
