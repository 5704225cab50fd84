"""bench.rpc_floor at CI size: every figure measured (its Verify steps checked on the way) and written."""

import json

from bench import rpc_floor


def test_rpc_floor_writes_its_figures(tmp_path):
    assert rpc_floor.main(["--calls", "20", "--repeats", "3", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("rpc_floor_*.json")
    report = json.loads(path.read_text())
    assert set(report["figures"]) == {"grpc_empty_unary_us", "thread_handoff_us", "verify_one_step_us"}
    assert all(v > 0 for v in report["figures"].values())
    # a served step pays at least the gRPC call it travels in
    assert report["figures"]["verify_one_step_us"] > report["figures"]["grpc_empty_unary_us"] * 0.5
