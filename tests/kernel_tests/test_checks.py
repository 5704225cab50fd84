"""kernels/checks.py: the launchers' shared checks name the op and the tensor, and say what was
wanted and what came."""

import pytest
import torch

from hybrid_kernels.checks import check_contiguous, check_operand, check_ragged, check_tensor

X = torch.zeros(3, 8)
ON_X = ("x", X)


def _raises(match: str, check, *args, **kwargs) -> None:
    with pytest.raises(ValueError, match=match):
        check(*args, **kwargs)


def test_operand():
    check_operand("op", "x", X, "[M, K]", (torch.float32,))
    _raises(r"^op: x must be 2-D \[M, K\], got shape \[3, 2, 4\]$", check_operand, "op", "x", X.view(3, 2, 4), "[M, K]", (torch.float32,))
    _raises(r"^op: x must be 3-D \[R, H, D\] \(a hint\), got shape \[3, 8\]$", check_operand, "op", "x", X, "[R, H, D]",
            (torch.float32,), hint=" (a hint)")
    _raises(r"^op: x dtype torch.float64 is not one of \(torch.float32,\)$", check_operand, "op", "x", X.double(), "[M, K]",
            (torch.float32,))


def test_tensor():
    check_tensor("op", "out", torch.zeros(3, 5), (3, 5), torch.float32, ON_X, contiguous=True)
    _raises(r"^op: out must have shape \[M, N\] = \[3, 5\], got \[3, 6\]$", check_tensor, "op", "out", torch.zeros(3, 6), (3, 5),
            torch.float32, ON_X, layout="[M, N]")
    _raises(r"^op: out must have shape \[3, 5\], got \[3, 6\]$", check_tensor, "op", "out", torch.zeros(3, 6), (3, 5), torch.float32, ON_X)
    _raises(r"^op: out dtype torch.bfloat16 != x dtype torch.float32$", check_tensor, "op", "out",
            torch.zeros(3, 5, dtype=torch.bfloat16), (3, 5), X.dtype, ON_X)
    _raises(r"^op: ids dtype torch.int32 != torch.int64$", check_tensor, "op", "ids", torch.zeros(3, dtype=torch.int32), (3,),
            torch.int64, ON_X)
    _raises(r"^op: w dtype torch.float16 is not one of", check_tensor, "op", "w", torch.zeros(3, dtype=torch.float16), (3,),
            (torch.float32, torch.bfloat16), ON_X)
    _raises(r"^op: out is on meta, x on cpu$", check_tensor, "op", "out", torch.zeros(3, 5, device="meta"), (3, 5), torch.float32, ON_X)
    _raises(r"^op: out must be contiguous, got strides \(1, 3\)$", check_tensor, "op", "out", torch.zeros(5, 3).t(), (3, 5),
            torch.float32, ON_X, contiguous=True)


def test_contiguous_along_last_dim():
    rows_strided = torch.zeros(3, 10)[:, :5]
    check_contiguous("op", "out", rows_strided, along="N")  # rows may be strided
    check_contiguous("op", "col", torch.zeros(2, 3)[:, :1], along="N")  # a size-1 last dim carries any stride
    _raises(r"^op: out must be contiguous along N, got strides \(1, 3\)$", check_contiguous, "op", "out", torch.zeros(5, 3).t(), along="N")
    _raises("out must be contiguous, got", check_contiguous, "op", "out", rows_strided)


def test_ragged():
    slots, cu_rows = torch.tensor([2, 0], dtype=torch.int32), torch.tensor([0, 1, 4], dtype=torch.int32)
    check_ragged("op", slots, cu_rows, ON_X)
    _raises(r"^op: seq_slots must be int32 \[S\], got shape \[1, 2\]$", check_ragged, "op", slots[None], cu_rows, ON_X)
    _raises("^op: seq_slots dtype torch.int64 != torch.int32$", check_ragged, "op", slots.long(), cu_rows, ON_X)
    _raises(r"^op: cu_rows must have shape \[S\+1\] = \[3\], got \[2\]$", check_ragged, "op", slots, cu_rows[:2], ON_X)
