/* e^x in 16 fp32 lanes (AVX-512), or 8 (AVX2 with FMA), for kvgen's C kernels: the softmax of
 * decode attention (paged_decode.c) and SwiGLU's sigmoid and GeGLU's tanh (step.c).
 *
 * x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, so r is exact to fp32), e^r by its Taylor
 * series to r^7 (truncation below 1e-8 relative, under half an fp32 ulp), scaled by 2^n. Very
 * negative x (masked scores' -inf included) gives 0, x above fp32's range gives +inf. exp8 takes the
 * same steps lane by lane, so the same bits: AVX2 has no vscalefps, and 2^n, n in [-150, 128], is
 * applied as two factors 2^(n - n/2) and 2^(n/2) of a normal fp32's range, the first product exact
 * (e^r is in [0.7, 1.5]) and the second rounded once, as vscalefps rounds. */
#include <immintrin.h>

/* The steps' constants, shared by both widths so that they stay one computation. */
#define EXP_LOWEST (-104.f)                 /* e^-104 rounds to 0 in fp32 */
#define EXP_HIGHEST 89.f                    /* e^89 overflows: 2^128 scales to +inf */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693145751953125f       /* ln2 in two parts: n * hi is exact */
#define EXP_LN2_LO 1.428606765330187045e-06f
#define EXP_TAYLOR {1.f / 5040, 1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}

#ifdef __AVX512F__
static inline __attribute__((always_inline)) __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_LOWEST)), _mm512_set1_ps(EXP_HIGHEST));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    static const float taylor[] = EXP_TAYLOR;
    __m512 p = _mm512_set1_ps(taylor[0]);
    for (int k = 1; k < 8; k++)
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(taylor[k]));
    return _mm512_scalef_ps(p, n);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* 2^k for integer k in [-126, 127], as fp32. */
static inline __attribute__((always_inline)) __m256 pow2_8(__m256i k) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23));
}

static inline __attribute__((always_inline)) __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LOWEST)), _mm256_set1_ps(EXP_HIGHEST));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    static const float taylor[] = EXP_TAYLOR;
    __m256 p = _mm256_set1_ps(taylor[0]);
    for (int k = 1; k < 8; k++)
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(taylor[k]));
    const __m256i whole = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(whole, 1);
    return _mm256_mul_ps(_mm256_mul_ps(p, pow2_8(_mm256_sub_epi32(whole, half))), pow2_8(half));
}
#endif
