/* Qwen3.5's gated attention output, out = x * sigmoid(gate), fp32: x the attention's rows [rows, heads,
 * D], gate the other half of each query head's projection (kvgen/model/blocks/gated_attention.py),
 * heads `gate_head` floats apart and rows `gate_row` apart. sigmoid(g) = 1 / (1 + e^-g) with libm's
 * expf, the product rounded once. In C so that the layer-by-layer forward and a fused decode step's
 * call list (kvgen/model/kernels/step.c) give the same bits: both call this. Built by
 * kvgen/model/kernels/output_gate.py. One thread: a decode row is a few thousand values.
 */
#include <math.h>
#include <stdint.h>

struct output_gate_args {
    const float *x;    /* [rows, heads, D] contiguous */
    const float *gate; /* [rows, heads, D], rows gate_row and heads gate_head floats apart */
    float *out;        /* [rows, heads, D] contiguous */
    int64_t rows, heads, dim, gate_row, gate_head;
};

int output_gate_call(const struct output_gate_args *a) {
    for (int64_t r = 0; r < a->rows; r++)
        for (int64_t h = 0; h < a->heads; h++) {
            const int64_t at = (r * a->heads + h) * a->dim;
            const float *restrict x = a->x + at, *restrict g = a->gate + r * a->gate_row + h * a->gate_head;
            float *restrict y = a->out + at;
            for (int64_t i = 0; i < a->dim; i++)
                y[i] = x[i] * (1.f / (1.f + expf(-g[i])));
        }
    return 0;
}
