"""When to launch a Triton kernel rather than its torch reference."""

from __future__ import annotations

import functools
import os

import torch


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """TRITON_INTERPRET=1: kernels run on the CPU through Triton's interpreter (tests only)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """Kernels serve CUDA tensors; CPU tensors take the torch reference."""
    return t.is_cuda and triton_available()


def pick(launcher, reference, t: torch.Tensor):
    """The launcher for CUDA tensors (when triton is there), else the torch reference."""
    return launcher if use_triton(t) else reference


@functools.lru_cache(maxsize=None)
def hopper(index: int | None) -> bool:
    """GPU `index` is compute capability 9 or later (programmatic dependent launch, TMA); read once per GPU."""
    return torch.cuda.get_device_capability(index) >= (9, 0)
