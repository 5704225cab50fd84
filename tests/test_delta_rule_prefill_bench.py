"""bench.delta_rule_prefill on the CPU at tiny shapes: it writes its results file, and the serial
and chunked forms it times agree (the CPU runs their torch references)."""

import json

import pytest

from bench import delta_rule_prefill


def test_the_bench_writes_both_forms_and_they_agree(tmp_path):
    code = delta_rule_prefill.main(["--out", str(tmp_path), "--device", "cpu", "--rows", "40", "--sequences", "1", "2",
                                    "--heads", "2", "--d-k", "16", "--d-v", "16", "--chunk", "16", "--repeats", "1"])
    assert code == 0
    (path,) = tmp_path.glob("delta_rule_prefill_*.json")
    result = json.loads(path.read_text())
    assert [(s["rows"], s["sequences"]) for s in result["shapes"]] == [(40, 1), (80, 2)]
    for shape in result["shapes"]:
        assert shape["serial_ms"] > 0 and shape["chunked_ms"] > 0
        # fp32 forms of one recurrence: far below a state's scale (a wrong sub-chunk is off by its order)
        assert shape["max_state_difference"] < 1e-5 * max(shape["state_scale"], 1.0)
        assert shape["max_out_difference"] < 1e-4


def test_tiles_are_named_as_columns_by_warps():
    args = delta_rule_prefill.parse_args(["--out", "x", "--serial-tiles", "8x1,16x2"])
    assert args.serial_tiles == ((8, 1), (16, 2))
    for bad in ("8", "8x3", "ax1"):
        with pytest.raises(SystemExit):
            delta_rule_prefill.parse_args(["--out", "x", "--serial-tiles", bad])
