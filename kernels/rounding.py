"""fp32 -> bf16 rounding shared by the kernels.

A GPU's fp32 -> bf16 cast rounds to nearest even; Triton's interpreter truncates. Rounding on the
bits first gives the same bf16 value on both, after which the cast itself is exact.
"""

import torch
import triton
import triton.language as tl

# the Triton dtype of each float dtype the kernels take (cast_rtne's DTYPE, a kernel's dtype constexpr)
TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16}


@triton.jit
def round_to_bf16(b):
    """fp32 block -> the nearest bf16 value (ties to even), still held in fp32; NaN passes through."""
    bits = b.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(b != b, b, bits.to(tl.float32, bitcast=True))


@triton.jit
def cast_rtne(b, DTYPE: tl.constexpr, EMULATE_BF16_RTNE: tl.constexpr):
    """fp32 b -> DTYPE, rounding to nearest even as torch's .to() and a GPU's cast do. Under the
    interpreter (EMULATE_BF16_RTNE, launchers pass interpreting()), which truncates fp32 -> bf16,
    the rounding is done on the bits first, after which the cast is exact."""
    if EMULATE_BF16_RTNE and DTYPE == tl.bfloat16:
        b = round_to_bf16(b)
    return b.to(DTYPE)
