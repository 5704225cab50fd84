"""fp32 -> bf16 rounding shared by the kernels.

A GPU's fp32 -> bf16 cast rounds to nearest even; Triton's interpreter truncates. Rounding on the
bits first gives the same bf16 value on both, after which the cast itself is exact.
"""

import triton
import triton.language as tl


@triton.jit
def round_to_bf16(b):
    """fp32 block -> the nearest bf16 value (ties to even), still held in fp32; NaN passes through."""
    bits = b.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(b != b, b, bits.to(tl.float32, bitcast=True))
