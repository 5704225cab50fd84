"""bench.fp8_walk off the GPU: how it picks a walk, and that it refuses to run without a device."""

import pytest

from bench import fp8_walk


def _times(one: float, many: float) -> dict:
    return {"split_k": 1, "programs": 1, "1": one, "4": one, "64": many, "576": many}


def test_best_is_the_fastest_few_rows_walk_within_the_many_rows_slack():
    shapes = {"a": {"pinned": _times(10, 100), "fast_few": _times(5, 200), "modest": _times(8, 104), "pinned_again": _times(10, 100)},
              "b": {"pinned": _times(10, 100), "fast_few": _times(5, 200), "modest": _times(9, 100), "pinned_again": _times(10, 100)}}
    assert fp8_walk.best(shapes, {"a": 1, "b": 1}) == "modest"  # fast_few doubles the many-rows time
    shapes["b"]["modest"] = {"split_k": 2, "error": "differs from the bf16 GEMM at [1] rows"}
    assert fp8_walk.best(shapes, {"a": 1, "b": 1}) == "pinned"  # a walk with other bits is never picked


@pytest.mark.skipif(fp8_walk.torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_refuses_without_a_gpu(tmp_path):
    with pytest.raises(SystemExit):
        fp8_walk.main(["--out", str(tmp_path)])
