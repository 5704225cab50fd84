"""bench.fp8_configs off the GPU: each expert candidate changes one stage only and keeps the pinned
block of pairs, the summary picks the fastest valid candidate per row count, and without a GPU
the command refuses."""

import pytest
import torch

from bench import fp8_configs, kernel_candidates
from hybrid_kernels.moe_grouped import grouped_config

STAGE1 = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
STAGE2 = ("BLOCK_N2", "BLOCK_K2", "num_warps2", "num_stages2")


def test_each_expert_candidate_changes_one_stage_and_keeps_the_block():
    pinned = grouped_config(2048, 512, torch.bfloat16, 257, 9, fp8=True)
    candidates = fp8_configs.expert_candidates(pinned)
    assert len(candidates) == len(set(candidates)) > 12
    for candidate in candidates:
        changed = {f for f in pinned._fields if getattr(candidate, f) != getattr(pinned, f)}
        assert changed <= set(STAGE1) or changed <= set(STAGE2), changed
        assert candidate.BLOCK_M == pinned.BLOCK_M and candidate.BLOCK_H == pinned.BLOCK_H


def test_summary_picks_the_fastest_valid_candidate_per_row_count():
    times = {"a": {"1": 2.0, "9": 1.0}, "b": {"1": 1.0, "9": 3.0}, "c": "OutOfResources: shared memory"}
    summary = fp8_configs._summary(times, "a", {"1": 4.0, "9": 2.0}, nbytes=1_000_000)
    assert summary["best_by_rows"]["1"] == {"config": "b", "ms": 1.0, "x_pinned": 4.0, "pinned_ms": 4.0,
                                           "pinned_gb_s": 0.2, "best_gb_s": 1.0}
    assert summary["best_by_rows"]["9"]["config"] == "a"
    assert summary["best_overall"] == "a"  # 2/4 + 1/2 of the pinned times against b's 1/4 + 3/2


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


def test_winners_are_applied_for_the_engine(tmp_path, monkeypatch):
    import json

    import hybrid_kernels.linear_fp8 as lf
    import hybrid_kernels.moe_grouped as mg

    pinned = grouped_config(2048, 512, torch.bfloat16, 257, 9, fp8=True)
    winner = pinned._replace(BLOCK_K=256, BLOCK_N2=32)
    dense = {"pinned_ms": {"1": 1.0}, "candidates": {"64,4,4": {"1": 1.0}, "128,4,1": {"1": 0.5}, "64,4,6": "refused"}}
    results = {"expert_fields": list(winner._fields), "dense_fields": ["ROWS_TILE_FEATURES", "ROWS_WARPS", "ROWS_STAGES"],
               "shapes": {"experts 257x512x2048x8": {"best_overall": ",".join(map(str, winner))},
                          "dense 12288x2048": dense,
                          "dense 2048x4096": {**dense, "candidates": {**dense["candidates"], "128,4,1": {"1": 3.0}}}}}
    (tmp_path / "r.json").write_text(json.dumps(results))
    for name in ("ROWS_TILE_FEATURES", "ROWS_WARPS", "ROWS_STAGES"):
        monkeypatch.setattr(lf, name, getattr(lf, name))
    monkeypatch.setattr(mg, "grouped_config", mg.grouped_config)
    applied = kernel_candidates.apply_winners(tmp_path / "r.json")
    assert mg.grouped_config(2048, 512, torch.bfloat16, 257, 9, fp8=True) == winner
    assert mg.grouped_config(2048, 512, torch.bfloat16, 257, 9) == grouped_config(2048, 512, torch.bfloat16, 257, 9)  # bf16 experts keep theirs
    # 128,4,1: 0.5 + 3.0 relative against the pinned launch's 1 + 1; 64,4,6 failed at a shape
    assert applied["rows kernel"] == "64,4,4" and (lf.ROWS_TILE_FEATURES, lf.ROWS_STAGES) == (64, 4)


def test_few_rows_candidates_change_launch_fields_only():
    import hybrid_kernels.moe_grouped as mg

    candidates = fp8_configs.few_rows_candidates()
    assert len(candidates) > 10
    for launch in candidates:
        assert set(launch) <= set(mg.LAUNCH_FIELDS), launch
        if "BLOCK_N" in launch:  # tl.dot's least tile; warps past one an n8 tile repeat MMAs (the screen checks the bits)
            assert launch["BLOCK_N"] >= 16 and launch["num_warps"] in (1, 2, 4, 8), launch
    # at one row a stage runs a program an SM: the screen tries more warps than n8 tiles
    assert any("BLOCK_N" in c and c["BLOCK_N"] < 8 * c["num_warps"] for c in candidates)


def test_many_rows_candidates_keep_the_mma_sync_blocks():
    import hybrid_kernels.moe_grouped as mg

    candidates = fp8_configs.many_rows_candidates()
    assert any(c.get("BLOCK_M") == mg.MMA_SYNC_ROWS for c in candidates)
    for launch in candidates:
        assert set(launch) <= {"BLOCK_M", *mg.LAUNCH_FIELDS} and launch.get("BLOCK_M", 16) in (16, mg.MMA_SYNC_ROWS), launch


def test_the_few_rows_launch_is_applied_for_the_engine(tmp_path, monkeypatch):
    import json

    import hybrid_kernels.moe_grouped as mg

    launch = {"BLOCK_N": 16, "num_warps": 1, "BLOCK_H": 128}
    results = {"shapes": {"experts 257x512x2048x8": {"few_rows": {"launch": launch}, "many_rows": {"launch": {"BLOCK_M": 32}}}}}
    (tmp_path / "r.json").write_text(json.dumps(results))
    monkeypatch.setattr(mg, "FEW_ROWS_LAUNCH", {})
    monkeypatch.setattr(mg, "MANY_ROWS_LAUNCH", {})
    monkeypatch.setattr(mg, "grouped_config", mg.grouped_config)
    applied = kernel_candidates.apply_winners(tmp_path / "r.json")
    assert mg.FEW_ROWS_LAUNCH == launch and applied["experts up to FEW_ROWS rows"] == "BLOCK_N=16,num_warps=1,BLOCK_H=128"
    assert mg.MANY_ROWS_LAUNCH == {"BLOCK_M": 32} and applied["experts from MANY_ROWS rows"] == "BLOCK_M=32"
    assert mg.grouped_config(2048, 512, torch.bfloat16, 257, 9, fp8=True) == grouped_config(2048, 512, torch.bfloat16, 257, 9, fp8=True)


def test_walks_are_put_in_place_and_named(monkeypatch):
    """--expert-walk and --dense-walk (bench.fp8_real_size, bench.row_invariance): each walk sets its
    kernel module's SCALE_AFTER_ON, the other kind's is left alone, and the results name the walk
    each kind takes (the code's defaults: scale-after for the experts, dequantize for dense GEMMs)."""
    import hybrid_kernels.linear_fp8 as lf
    import hybrid_kernels.moe_grouped as mg
    from bench.kernel_candidates import WALKS, apply_walk, current_walk

    for module in (mg, lf):
        monkeypatch.setattr(module, "SCALE_AFTER_ON", module.SCALE_AFTER_ON)  # restored after the test
    assert current_walk("expert") == "scale-after" and current_walk("dense") == "dequantize"
    for kind, module, other in (("expert", mg, lf), ("dense", lf, mg)):
        before = other.SCALE_AFTER_ON
        for name, on in WALKS.items():
            apply_walk(kind, name)
            assert current_walk(kind) == name and module.SCALE_AFTER_ON is on and other.SCALE_AFTER_ON is before
