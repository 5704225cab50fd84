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
