"""Programmatic dependent launch (PDL): a kernel's blocks start while the kernel before it finishes.
The design in full: DESIGN.md section 6, "Programmatic dependent launch".
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .runtime import hopper, interpreting

_OFF = {"PDL": False}
_ON = {"PDL": True, "launch_pdl": True}
_suspension = threading.local()  # .depth > 0: this thread's launches are made without PDL


@triton.jit
def after_previous(PDL: tl.constexpr):
    """A kernel's first statement: wait for the kernel before it, then let the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


# Bytes of its weight a program asks L2 for before it waits (`prefetch_rows`).
PREFETCH_BYTES = 128 * 1024


def prefetch_bytes(device: torch.device) -> int:
    """The PREFETCH constexpr of a launch on `device`: PREFETCH_BYTES where launches are made with PDL, else 0."""
    return PREFETCH_BYTES if launch_options(device)["PDL"] else 0


@triton.jit
def _prefetch_l2(p):
    """Ask L2 for the 128-byte line at each address of p (int64, global memory); nothing is read back."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [p], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def prefetch_rows(p_rows, n_k, PREFETCH: tl.constexpr):
    """Ask L2 for up to PREFETCH bytes of a program's weight rows: p_rows [R] points at each row's
    first element of n_k contiguous ones; the first PREFETCH // R bytes of every row, in 128-byte lines."""
    ELEM: tl.constexpr = p_rows.dtype.element_ty.primitive_bitwidth // 8
    R: tl.constexpr = p_rows.shape[0]
    LINES: tl.constexpr = PREFETCH // (R * 128)
    if LINES > 0:
        o_k = tl.minimum(tl.arange(0, LINES) * (128 // ELEM), n_k - 1)
        _prefetch_l2((p_rows[:, None] + o_k[None, :]).to(tl.int64))


def launch_options(device: torch.device) -> dict:
    """Keyword arguments for a launch on `device` (a tensor's device): the kernel's PDL constexpr,
    and Triton's launch_pdl flag when PDL is on."""
    if device.type != "cuda" or interpreting() or getattr(_suspension, "depth", 0):
        return _OFF
    return _options(device.index)


@contextlib.contextmanager
def suspended():
    """Within it, this thread's launches are made without PDL (a kernel's PDL constexpr False: the
    same kernel compiled without the wait, the same bits)."""
    _suspension.depth = getattr(_suspension, "depth", 0) + 1
    try:
        yield
    finally:
        _suspension.depth -= 1


@functools.lru_cache(maxsize=None)
def _options(index: int) -> dict:
    """Per GPU, read once: VERIFIER_PDL is a per-process switch."""
    on = os.environ.get("VERIFIER_PDL", "1") != "0" and hopper(index)
    return _ON if on else _OFF
