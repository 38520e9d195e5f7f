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

/* One row at a time: LOAD widens an element to fp32, FINISH(w, xr) makes y from the weight and
 * x * r. x, y [rows, n] and w [n] are ELEM. */
#define RMS_NORM(NAME, ELEM, LOAD, FINISH)                                                                \
    void NAME(const ELEM *restrict x, int64_t rows, int64_t n, const ELEM *restrict w, float eps,         \
              ELEM *restrict y) {                                                                         \
        for (int64_t r = 0; r < rows; r++, x += n, y += n) {                                              \
            float squares = 0.f;                                                                          \
            _Pragma("omp simd reduction(+ : squares)") for (int64_t i = 0; i < n; i++)                    \
                squares += LOAD(x[i]) * LOAD(x[i]);                                                       \
            const float inverse = 1.f / sqrtf(squares / (float)n + eps);                                  \
            _Pragma("omp simd") for (int64_t i = 0; i < n; i++)                                           \
                y[i] = FINISH(w[i], LOAD(x[i]) * inverse);                                                \
        }                                                                                                 \
    }

#define AS_IS(v) (v)
#define F32_FINISH(w, xr) ((w) * (xr))
#define BF16_FINISH(w, xr) to_bf16(from_bf16(w) * from_bf16(to_bf16(xr)))

RMS_NORM(rms_norm_f32, float, AS_IS, F32_FINISH)
RMS_NORM(rms_norm_bf16, uint16_t, from_bf16, BF16_FINISH)

/* One call's arguments as a struct, for a call list (kvgen/model/kernels/step.c). */
struct rms_norm_args {
    const void *x;
    int64_t rows, n;
    const void *w;
    float eps;
    void *y;
};

int rms_norm_f32_call(const struct rms_norm_args *a) {
    rms_norm_f32(a->x, a->rows, a->n, a->w, a->eps, a->y);
    return 0;
}

int rms_norm_bf16_call(const struct rms_norm_args *a) {
    rms_norm_bf16(a->x, a->rows, a->n, a->w, a->eps, a->y);
    return 0;
}
