"""Programmatic dependent launch (PDL): a kernel's blocks start while the kernel before it finishes.

A decode step of a small model is a few hundred short kernels in one CUDA graph, and each kernel
boundary costs the next kernel's launch and block scheduling on top of its work. With PDL (Hopper
and newer) a kernel launched with `launch_pdl` may be scheduled as soon as every block of the
kernel before it has signalled (`gdc_launch_dependents`); its blocks then wait (`gdc_wait`) until
that kernel has completed and its writes are visible. The launch overlaps the previous kernel's
tail; nothing a kernel computes changes, so no bit does.

The rule that keeps it safe: every kernel launched with PDL calls `after_previous(PDL)` before it
touches global memory. The wait blocks until the previous grid has completed, and that grid could
not complete before its own wait returned, so a kernel also sees the writes of every kernel before
it, not just the last one. `launch_options` gives the kernel's PDL constexpr and the launch flag
together, so a kernel is never launched early without its wait.

Off: on the CPU (Triton's interpreter has no grid dependency control), below compute capability
9.0, when VERIFIER_PDL=0 (A/B runs, or to rule it out when debugging), and for the launches made
inside `suspended()`: the CUDA graphs of large buckets are captured so (verifier/model/graphs.py,
PDL_MAX_ROWS), where their kernels run several waves and a kernel's blocks, resident early and
waiting, slow the step (H200, 2B model, timed in turns with and without PDL; bench.gpu's `pdl`
section times the batch-1 steps both ways).
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
