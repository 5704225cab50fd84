"""Triton kernels for the GPU path, one module per op: the Triton kernel, its launcher, and a torch
reference `<op>_ref` with the same signature and one shape docstring (DESIGN.md section 6). Three
helper modules serve them all: `checks` (the launchers' argument checks), `rounding` (fp32 -> bf16
rounding that the interpreter gets right too) and `runtime` (when to launch a kernel).

The torch references are what the CPU reference backend computes; the launchers are what the
CUDA backend computes. Bits match within a backend (verify == serial decode), not across them.
Tests run the kernels on the CPU under TRITON_INTERPRET=1 at tiny shapes.
"""
