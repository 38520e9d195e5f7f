"""Compiles the paged decode kernels for sm90 (the H200) on a machine without a GPU: Triton's own
ptxas builds the cubins, so a kernel that the interpreter runs but the compiler refuses fails here,
before a device run. Run from the repository root: `PYTHONPATH=$PWD python benchmarks/triton_compile_check.py`.
The H200 machine runs triton 3.6: this checks with the installed triton, not that version."""

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvgen.gpu import triton_attention as ta

TARGET = GPUTarget("cuda", 90, 64)
DECODE = ["q_ptr", "k_ptr", "v_ptr", "ks_ptr", "vs_ptr", "bt_ptr", "lo_ptr", "hi_ptr", "o_ptr", "pm_ptr", "pl_ptr",
          "pacc_ptr", "stride_qr", "stride_qh", "stride_ph", "stride_ps", "stride_bt", "stride_ksh", "stride_kss",
          "stride_vsh", "stride_vss", "stride_or", "stride_oh", "rows_per_seq", "qk_scale", "splits"]
REDUCE = ["pm_ptr", "pl_ptr", "pacc_ptr", "lo_ptr", "hi_ptr", "o_ptr", "stride_or", "stride_oh", "heads", "splits"]


def build(fn, names, types, constants):
    signature = dict(zip(names, types))
    signature.update({k: "constexpr" for k in constants})
    return triton.compile(ASTSource(fn, signature, constants), target=TARGET)


def main() -> None:
    # (model dtype, pool dtype, quantized, GQA group, one split)
    for qt, pt, quant, group, direct in [("bf16", "bf16", False, 6, False), ("bf16", "bf16", False, 6, True),
                                         ("bf16", "i8", True, 6, False), ("bf16", "fp8e4nv", True, 16, False),
                                         ("bf16", "bf16", False, 16, False), ("fp16", "fp16", False, 16, True),
                                         ("fp32", "fp32", False, 16, False)]:
        types = (["*" + qt, "*" + pt, "*" + pt, "*fp32", "*fp32", "*i64", "*i32", "*i32", "*" + qt]
                 + ["*fp32"] * 3 + ["i32"] * 12 + ["fp32", "i32"])
        group_p = triton.next_power_of_2(group)
        constants = dict(BLOCK_SIZE=16, GROUP=group, GROUP_P=group_p, D=128, D_P=128,
                         BLOCK_N=ta._decode_block_n(group_p, 128), QUANT=quant, KEY_GROUP=16 if quant else 128,
                         DIRECT=direct, DOT=group_p >= 16, IEEE=qt == "fp32")
        kernel = build(ta._decode_kernel, DECODE, types, constants)
        print(f"decode {qt} model, {pt} pool, group {group}, one split {direct}: {len(kernel.asm['cubin'])} B cubin")
    kernel = build(ta._decode_reduce_kernel, REDUCE, ["*fp32"] * 3 + ["*i32", "*i32", "*bf16"] + ["i32"] * 4,
                   dict(D=128, D_P=128, BLOCK_N=16, SPLIT_TILE=16))
    print(f"reduce: {len(kernel.asm['cubin'])} B cubin")


if __name__ == "__main__":
    main()
