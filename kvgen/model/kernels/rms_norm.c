/* RMSNorm over the rows of x, fp32 or bf16, as Hugging Face's LlamaRMSNorm computes it:
 *
 *     r = 1 / sqrt(mean(x^2) + eps)      in fp32, whatever x's dtype
 *     y = w * (x * r)                    fp32: in fp32; bf16: x * r rounded to bf16, then the
 *                                        bf16 product with w rounded again (torch's bf16 multiply)
 *
 * Built by kvgen/model/kernels/norm.py with the system's C compiler (-O3 -march=native, no AMX) and
 * called through ctypes. Why not torch.rms_norm: a decode step normalizes 61 rows of a few hundred
 * values, and torch's op costs ~16 us a call in fp32 and ~30 us in bf16 (with its casts), 1-2 ms of a
 * step, for work that takes under a microsecond. One thread: a row is too small to share.
 */
#include <math.h>
#include <stdint.h>

#include "bf16_bits.h"

/* x, y [rows, n] fp32, w [n] fp32. */
void rms_norm_f32(const float *restrict x, int64_t rows, int64_t n, const float *restrict w, float eps,
                  float *restrict y) {
    for (int64_t r = 0; r < rows; r++, x += n, y += n) {
        float squares = 0.f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < n; i++)
            squares += x[i] * x[i];
        const float inverse = 1.f / sqrtf(squares / (float)n + eps);
#pragma omp simd
        for (int64_t i = 0; i < n; i++)
            y[i] = w[i] * (x[i] * inverse);
    }
}

/* x, y [rows, n] bf16, w [n] bf16. */
void rms_norm_bf16(const uint16_t *restrict x, int64_t rows, int64_t n, const uint16_t *restrict w, float eps,
                   uint16_t *restrict y) {
    for (int64_t r = 0; r < rows; r++, x += n, y += n) {
        float squares = 0.f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < n; i++)
            squares += from_bf16(x[i]) * from_bf16(x[i]);
        const float inverse = 1.f / sqrtf(squares / (float)n + eps);
#pragma omp simd
        for (int64_t i = 0; i < n; i++)
            y[i] = to_bf16(from_bf16(w[i]) * from_bf16(to_bf16(from_bf16(x[i]) * inverse)));
    }
}
