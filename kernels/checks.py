"""What every launcher checks before a launch: each failed check raises ValueError naming the op and
the tensor, with what was wanted and what came.

A launcher checks its operand (the tensor it takes its dtype and device from) with `check_operand`
and `check_launchable`, then every other tensor against that operand with `check_tensor`. A torch
reference may run the same checks on its (same) arguments, all but `check_launchable`.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .runtime import interpreting


def check_launchable(op: str, name: str, t: torch.Tensor) -> None:
    """Triton kernels run on CUDA tensors, or on CPU ones under TRITON_INTERPRET=1 (tests)."""
    if not t.is_cuda and not interpreting():
        raise ValueError(f"{op}: {name} is on {t.device}; the Triton kernel needs a CUDA tensor (or TRITON_INTERPRET=1)")


def check_operand(op: str, name: str, t: torch.Tensor, layout: str, dtypes: tuple[torch.dtype, ...], hint: str = "") -> None:
    """The operand: as many dims as `layout` names ("[M, K]") and a dtype of `dtypes`.
    hint: said after the layout when the dims are wrong (how to reshape, say)."""
    ndim = layout.count(",") + 1
    if t.dim() != ndim:
        raise ValueError(f"{op}: {name} must be {ndim}-D {layout}{hint}, got shape {list(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{op}: {name} dtype {t.dtype} is not one of {dtypes}")


def check_tensor(op: str, name: str, t: torch.Tensor, shape: Sequence[int], dtype: torch.dtype | tuple[torch.dtype, ...],
                 operand: tuple[str, torch.Tensor], *, layout: str = "", contiguous: bool = False) -> None:
    """Another tensor of the launch: this shape, this dtype (or one of these), on the operand's device.

    operand: (its name, the tensor), for the device and for naming a dtype taken from it.
    layout: the shape's dims by name ("[M, N]"), said before the sizes.
    contiguous: the whole tensor must be contiguous (the kernel indexes it densely)."""
    operand_name, operand_t = operand
    if tuple(t.shape) != tuple(shape):
        named = f"{layout} = " if layout else ""
        raise ValueError(f"{op}: {name} must have shape {named}{list(shape)}, got {list(t.shape)}")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes:
        if len(dtypes) > 1:
            raise ValueError(f"{op}: {name} dtype {t.dtype} is not one of {dtypes}")
        want = f"{operand_name} dtype {operand_t.dtype}" if dtypes[0] == operand_t.dtype else str(dtypes[0])
        raise ValueError(f"{op}: {name} dtype {t.dtype} != {want}")
    if t.device != operand_t.device:
        raise ValueError(f"{op}: {name} is on {t.device}, {operand_name} on {operand_t.device}")
    if contiguous:
        check_contiguous(op, name, t)


def check_contiguous(op: str, name: str, t: torch.Tensor, along: str = "") -> None:
    """The whole tensor contiguous, or (along: the last dim's name) only its last dim, rows strided.
    A size-1 last dim may carry any stride (torch ignores it)."""
    if along:
        if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{op}: {name} must be contiguous along {along}, got strides {t.stride()}")
    elif not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous, got strides {t.stride()}")


def contiguous_aligned(t: torch.Tensor) -> torch.Tensor:
    """t itself when it is contiguous and starts 16-byte aligned, else a copy that is: the operand a
    kernel specialised on alignment reads (one compiled kernel whatever the caller's view; the
    copy's values are t's, so its bits are too)."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def check_ragged(op: str, seq_slots: torch.Tensor, cu_rows: torch.Tensor, operand: tuple[str, torch.Tensor]) -> None:
    """A ragged batch's layout: seq_slots int32 [S] (each sequence's slot), cu_rows int32 [S+1]
    (sequence s owns rows cu_rows[s] .. cu_rows[s+1]-1), both on the operand's device. Their
    values live on the device and are not checked (that would sync)."""
    if seq_slots.dim() != 1:
        raise ValueError(f"{op}: seq_slots must be int32 [S], got shape {list(seq_slots.shape)}")
    check_tensor(op, "seq_slots", seq_slots, seq_slots.shape, torch.int32, operand)
    check_tensor(op, "cu_rows", cu_rows, (seq_slots.shape[0] + 1,), torch.int32, operand, layout="[S+1]")
