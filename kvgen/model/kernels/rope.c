/* Rotary embedding in place, fp32 or bf16, with the bits of kvgen.model.layers.apply_rope (HF's
 * x * cos + rotate_half(x) * sin, the minus sign folded into the sin table):
 *
 *     x[i]     = x[i] * cos[i]     + x[i + D/2] * sin[i]          for i < D/2
 *     x[i+D/2] = x[i+D/2] * cos[i+D/2] + x[i] * sin[i+D/2]
 *
 * each product and the sum rounded once to the element type, as torch's ops round them (so built
 * with -ffp-contract=off: a fused multiply-add would round once less). Built by
 * kvgen/model/kernels/rope.py and called through ctypes. Why not torch: a decode step rotates one
 * row of a dozen heads per layer, and apply_rope's split, cat and three products cost ~25 us a call
 * there for well under a microsecond of work. One thread.
 */
#include <stdint.h>

#include "bf16_bits.h"

/* x: `rows` rows of `heads` heads of `dim` elements, `stride` elements from one row to the next
 * (q and k sit at the front of a q/k/v projection's row); cos, sin [rows, dim]. LOAD widens an
 * element to fp32, ROUND rounds an fp32 to the element type. */
#define ROPE(NAME, ELEM, LOAD, ROUND)                                                                     \
    void NAME(ELEM *x, int64_t rows, int64_t heads, int64_t dim, int64_t stride, const ELEM *cos,         \
              const ELEM *sin) {                                                                          \
        const int64_t half = dim / 2;                                                                     \
        for (int64_t r = 0; r < rows; r++, cos += dim, sin += dim)                                        \
            for (int64_t h = 0; h < heads; h++) {                                                         \
                ELEM *restrict v = x + r * stride + h * dim;                                              \
                _Pragma("omp simd") for (int64_t i = 0; i < half; i++) {                                  \
                    const float a = LOAD(v[i]), b = LOAD(v[i + half]);                                    \
                    v[i] = ROUND(LOAD(ROUND(a * LOAD(cos[i]))) + LOAD(ROUND(b * LOAD(sin[i]))));          \
                    v[i + half] = ROUND(LOAD(ROUND(b * LOAD(cos[i + half]))) +                            \
                                        LOAD(ROUND(a * LOAD(sin[i + half]))));                            \
                }                                                                                         \
            }                                                                                             \
    }

#define AS_IS(v) (v)

ROPE(rope_f32, float, AS_IS, AS_IS)
ROPE(rope_bf16, uint16_t, from_bf16, to_bf16)

/* One call's arguments as a struct, for a call list (kvgen/model/kernels/step.c). */
struct rope_args {
    void *x;
    int64_t rows, heads, dim, stride;
    const void *cos, *sin;
};

int rope_f32_call(const struct rope_args *a) {
    rope_f32(a->x, a->rows, a->heads, a->dim, a->stride, a->cos, a->sin);
    return 0;
}

int rope_bf16_call(const struct rope_args *a) {
    rope_bf16(a->x, a->rows, a->heads, a->dim, a->stride, a->cos, a->sin);
    return 0;
}
