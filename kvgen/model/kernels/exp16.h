/* e^x in 16 fp32 lanes (AVX-512), for kvgen's C kernels: the softmax of decode attention
 * (paged_decode.c) and SwiGLU's sigmoid (step.c).
 *
 * x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, so r is exact to fp32), e^r by its Taylor
 * series to r^7 (truncation below 1e-8 relative, under half an fp32 ulp), scaled by 2^n. Very
 * negative x (masked scores' -inf included) gives 0, x above fp32's range gives +inf. */
#include <immintrin.h>

static inline __attribute__((always_inline)) __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.f)); /* e^-104 rounds to 0 in fp32 */
    x = _mm512_min_ps(x, _mm512_set1_ps(89.f));   /* e^89 overflows: 2^128 scales to +inf */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    static const float taylor[] = {1.f / 5040, 1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};
    __m512 p = _mm512_set1_ps(taylor[0]);
    for (int k = 1; k < 8; k++)
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(taylor[k]));
    return _mm512_scalef_ps(p, n);
}
