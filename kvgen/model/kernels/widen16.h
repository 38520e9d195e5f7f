/* 16 bf16 values from p as fp32 (a bf16 is the high half of an fp32), for kvgen's AVX-512 attention
 * kernels: K/V pools and gathered copies in bf16 (paged_decode.c, prefill_attention.c). */
#include <immintrin.h>
#include <stdint.h>

static inline __attribute__((always_inline)) __m512 widen_bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
