"""Weights that stay quantized in memory, and the kernels that read them that way.

Entry points (each returns a kvgen.model.linear.Linear):

    make_quantized_linear(ggml_type, raw, shape, bias, device, dtype, activations)  a GGUF matrix's blocks
    quantize_linear(weight, "int8" | "int4", bias, activations)                    a float weight

`activations` ("int8" or "int8x2") is how the kernel quantizes x: see kvgen.model.quant.linear.
For the model: gguf_blocks.convert (or block_pack.BlockPacker.pack for parts of one type, stacked as
they pack) + formats.concat_rows + linear.packed_linear build fused q/k/v and gate/up layers
(llama.cpp's q/k row permutation applies to whole rows, so it can be applied to the raw blocks,
uint8 [out, bytes per row], before converting); formats.dequantize_rows looks up a packed embedding
table's rows (tied embeddings share it with the LM head). Q4_0, Q4_1, Q8_0, Q5_0 and Q5_1 are packed
in C at load (block_pack.c, from the file's memory map), the K-quants of the generic format in numpy.

Which GGUF type gets which kernel (formats.py for the format, gguf_blocks.py for the conversions,
all exact: the kernel's weights equal gguf's dequantization bit for bit):

    Q4_0, Q4_1          qmatmul_u4_g32_f16   4-bit codes, fp16 scale (and min) per 32
    Q4_K                qmatmul_u4_g32_f32   4-bit codes, fp32 scale d*sc and min -dmin*m per 32
    Q8_0, Q5_0, Q5_1    qmatmul_u8_g32_f16   8-bit codes, fp16 scale (and min) per 32
    Q5_K                qmatmul_u8_g32_f32   8-bit codes, fp32 scale and min per 32
    Q6_K, Q3_K, Q2_K    qmatmul_u8_g16_f32   8-bit codes, fp32 scale (and min) per 16
    anything else       dequantized with gguf to `dtype`, then kvgen.model.linear.make_linear

On a CPU with AVX-512 VNNI the model's Q4_K, Q5_K and Q6_K matrices take their own layout instead,
close to the file's (kquant_format.py: panels of 16 rows with the file's integer scales, 4.625 /
5.625 / 6.625 bits a weight), packed at load by kquant_pack.c straight from the file's memory map
and read by kquant.c at every row count (kquant_linear.KQuantLinear, chosen by
kvgen.model.projections).
    int8 / int4         qmatmul_u8_g32_* / qmatmul_u4_g32_* (fp16 scales where they fit)

The qmatmul_* kernels (qmatmul.c) need AVX-512 F/BW/VL/VNNI, FMA and F16C, or else AVX2, FMA and
F16C (a second build of the same source, kernel.py). On CUDA the same packed
weights go through TorchQuantLinear (dequantize, then F.linear); a CPU without those features gets
the dequantized fp32 weights through kvgen.model.linear. `describe(layer)` gives (kernel, weight
bytes) for the start-up log and `generate --json`.
"""

from kvgen.model.quant.linear import (
    QuantLinear,
    describe,
    make_quantized_linear,
    quantize_linear,
)

__all__ = ["QuantLinear", "describe", "make_quantized_linear", "quantize_linear"]
