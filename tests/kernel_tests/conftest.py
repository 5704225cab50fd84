import pytest
import torch

from hybrid_kernels.runtime import interpreting, triton_available

if not triton_available():
    pytest.skip("triton is not installed", allow_module_level=True)

ROW_COUNTS = [1, 2, 3, 5, 8, 15, 16, 17, 33, 64]  # DESIGN.md section 6


@pytest.fixture
def device():
    """Where kernels run: the GPU when there is one, else the CPU under TRITON_INTERPRET=1."""
    if torch.cuda.is_available():
        return "cuda"
    if not interpreting():
        pytest.skip("no GPU and TRITON_INTERPRET is not set")
    return "cpu"


def nan_like(t: torch.Tensor) -> torch.Tensor:
    """Output buffers pre-filled with NaN, so rows a kernel fails to write show up."""
    return torch.full_like(t, float("nan"))


def assert_refused(case, device: str, *ops) -> None:
    """Every one of `ops` (a launcher, and its torch reference where it checks the same arguments) refuses
    the arguments `case = (build, message)` builds for `device` with a ValueError matching `message`."""
    build, message = case
    for op in ops:
        with pytest.raises(ValueError, match=message):
            op(**build(device))


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> None:
    """One comparison helper: names the tensor, reports max/mean error, fails on NaN."""
    assert got.shape == want.shape, f"{name}: shape {list(got.shape)} != {list(want.shape)}"
    assert not torch.isnan(got).any(), f"{name}: NaN in the kernel output (an unwritten element?)"
    err = (got.float() - want.float()).abs()
    bound = atol + rtol * want.float().abs()
    assert (err <= bound).all(), f"{name}: max err {err.max():.3e}, mean err {err.mean():.3e} (rtol {rtol}, atol {atol})"
