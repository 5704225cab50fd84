"""bench.fp8_configs off the GPU: the candidates keep the 64-row FP8 tile the contract needs, the
summary picks the fastest valid candidate per row count, and without a GPU the command refuses."""

import pytest

from bench import fp8_configs
from hybrid_kernels.linear_fp8 import FP8_BLOCK_M


def test_every_dense_candidate_keeps_the_64_row_tile():
    assert {c.BLOCK_M for c in fp8_configs.DENSE_CANDIDATES} == {FP8_BLOCK_M}


def test_summary_picks_the_fastest_valid_candidate_per_row_count():
    times = {"a": {"1": 2.0, "9": 1.0}, "b": {"1": 1.0, "9": 3.0}, "c": "OutOfResources: shared memory"}
    summary = fp8_configs._summary(times, "a", {"1": 4.0, "9": 2.0}, nbytes=1_000_000)
    assert summary["best_by_rows"]["1"] == {"config": "b", "ms": 1.0, "x_pinned": 4.0, "pinned_ms": 4.0,
                                           "pinned_gb_s": 0.2, "best_gb_s": 1.0}
    assert summary["best_by_rows"]["9"]["config"] == "a"
    assert summary["best_overall"] == "a"  # 3.0 ms over both row counts against b's 4.0


def test_expert_bytes_count_the_experts_random_rows_reach():
    times = {"a": {"1": 1.0, "64": 1.0}}
    best = fp8_configs._summary(times, "a", {"1": 1.0, "64": 1.0}, nbytes=1_000_000, top_k=8, experts=256)["best_by_rows"]
    assert best["1"]["best_gb_s"] == 8.0  # one row: top_k experts
    assert 8.0 * 20 < best["64"]["best_gb_s"] < 256.0  # 64 rows: most of the 256, never more


@pytest.mark.skipif(fp8_configs.torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_without_a_gpu_it_refuses(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        fp8_configs.main(["--out", str(tmp_path)])
    assert exit_.value.code == 2 and "CUDA" in capsys.readouterr().err
