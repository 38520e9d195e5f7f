"""Weight formats: how a matrix is held in memory for a kernel to read, and how it gets there.

    packed.py         the generic packed format (codes of 4 or 8 bits, a scale and min per group of
                      16 or 32, in panels the qmatmul kernels stream), dequantize, stacking of parts
    kquant.py         Q4_K / Q5_K / Q6_K in kquant.c's own layout (panels of 16 rows with the file's
                      integer scales: 4.625 / 5.625 / 6.625 bits a weight)
    gguf_blocks.py    a GGUF matrix's blocks -> the generic format, exactly (gguf's values bit for bit)
    float_weights.py  float weights -> int8 / int4 in groups of 32 (`--quantization int8|int4`)
    coded.py          fp32 / bf16 weights coded losslessly (the top byte as a 4-bit code, outliers apart)

The packers that write these layouts from a file's memory map are C (kernels/block_pack.c,
kernels/kquant_pack.c) with their bindings beside them in kvgen.model.kernels; the linear layers
that read them are in kvgen.model.quant_linear, and kvgen.model.linear_choice picks one per projection.

Which GGUF type gets which kernel (all exact: the kernel's weights equal gguf's dequantization):

    Q4_0, Q4_1          qmatmul_u4_g32_f16   4-bit codes, fp16 scale (and min) per 32
    Q4_K                qmatmul_u4_g32_f32   4-bit codes, fp32 scale d*sc and min -dmin*m per 32
    Q8_0, Q5_0, Q5_1    qmatmul_u8_g32_f16   8-bit codes, fp16 scale (and min) per 32
    Q5_K                qmatmul_u8_g32_f32   8-bit codes, fp32 scale and min per 32
    Q6_K, Q3_K, Q2_K    qmatmul_u8_g16_f32   8-bit codes, fp32 scale (and min) per 16
    int8 / int4         qmatmul_u8_g32_* / qmatmul_u4_g32_* (fp16 scales where they fit)
    anything else       dequantized with gguf to the model's dtype, a float layer

On a CPU with AVX-512 VNNI, Q4_K, Q5_K and Q6_K take kquant.py's layout instead, read by kquant.c at
every row count. The qmatmul kernels need AVX-512 F/BW/VL/VNNI, FMA and F16C, or else AVX2, FMA and
F16C (a second build of the same source); on CUDA the packed weights are dequantized per call.
"""
