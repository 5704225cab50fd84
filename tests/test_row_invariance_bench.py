"""bench/row_invariance.py without a GPU: the weights it sweeps are those the engine multiplies,
as the loader joins them, in bf16 and as the published block-FP8 files store them; and
bench/gpu_tests.py reads pytest's summary line."""

import pytest

from bench.gpu_tests import counts, failed_tests
from bench.row_invariance import main, model_weights, sweep_configs
from presets.published import PUBLISHED, PUBLISHED_SIZES


def test_every_published_config_is_swept():
    assert set(PUBLISHED) | set(PUBLISHED_SIZES) <= set(sweep_configs())


def test_weights_as_the_engine_joins_them():
    """Qwen3.6-35B-A3B: GDN's q|k|v|z|b|a is one bf16 GEMM, or in FP8 the q|k|v|z GEMM beside the
    kept b|a one; attention's q|k|v and the projections are FP8; the router (the shared expert's
    gate its last row) and the head stay bf16; the experts, the shared expert folded in as the
    last, are [E + 1, I, H] with top-k 8."""
    config = PUBLISHED["Qwen3.6-35B-A3B"]
    bf16 = model_weights(config, fp8=False)
    assert ("dense", "bf16", (12352, 2048)) in bf16 and ("experts", "bf16", (257, 512, 2048, 8)) in bf16
    assert {dtype for _, dtype, _ in bf16} == {"bf16"}
    fp8 = model_weights(config, fp8=True)
    assert {("dense", "fp8", (12288, 2048)), ("dense", "bf16", (64, 2048)), ("dense", "fp8", (9216, 2048)),
            ("dense", "fp8", (2048, 4096)), ("dense", "bf16", (257, 2048)), ("dense", "bf16", (248320, 2048)),
            ("experts", "fp8", (257, 512, 2048, 8))} == set(fp8)
    assert len(fp8["dense", "fp8", (12288, 2048)]) == 30  # one per GDN layer


def test_kimi_router_is_fp32():
    assert ("dense", "fp32", (256, 2304)) in model_weights(PUBLISHED_SIZES["Kimi-Linear-48B-A3B"], fp8=True)


def test_needs_a_gpu(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the refusal is for machines without a GPU")
    assert main(["--out", str(tmp_path)]) == 2
    assert "CUDA" in capsys.readouterr().err


def test_pytest_summary_counts():
    assert counts("2 failed, 766 passed, 2 skipped in 207.90s (0:03:27)") == {"failed": 2, "passed": 766, "skipped": 2}
    assert counts("1 error in 3.1s") == {"error": 1}


def test_every_failed_test_is_kept_not_only_the_tail():
    lines = ["x" * 10] + [f"FAILED tests/t.py::test_{i} - AssertionError" for i in range(30)] + ["ERROR tests/u.py - ImportError",
                                                                                         "30 failed, 1 error in 9.0s"]
    assert failed_tests(lines) == lines[1:-1]
