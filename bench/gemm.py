"""The row-invariant GEMM against cuBLAS on the 2B model's weight shapes (issue 14, items 1 and 6).

    PYTHONPATH=. python -m bench.gemm --out DIR

For each weight shape the engine multiplies by (the fused projections as verifier/model/layers
builds them) and each row count M in 1, 9, 72, 576 (decode, one K=8 verify, 8 and 64 sequences of
K=8 verifies): kernels.linear (its tile for M rows) and torch.matmul (cuBLAS), each launch replayed
from a CUDA graph (no Python in the timing), median of --repeats; TFLOP/s = 2 M N K / time.
Correctness first, no figure without it: `row_invariant` says that every row of the M-row product
equals the same row in a 1024-row product and computed alone, bitwise; and a sweep of tiles (rows
16/64/128 per program, 64-256 features, 4 or 8 warps, 3 or 4 stages) run on the same K walk gives
the pinned tile's bits (kernels/linear.py: the K walk, not the tile, fixes a row's sum).
Writes DIR/gemm_<date>.json: device, date, torch, triton, per shape N, K, split_k, per M
ours_ms, cublas_ms, ours_tflops, cublas_tflops, ours_over_cublas and the tile used; row_invariant;
tiles_equal (equal / tried). Exit 1 when a check is red.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
from triton.runtime.errors import OutOfResources

from bench.machine import device_name
from kernels.linear import linear, linear_config, tile_for_rows

HIDDEN, INTERMEDIATE, VOCAB = 2048, 6144, 151936
# [N, K] as the engine multiplies (bench/gpu.py's 2B checkpoint): GDN's q|k|v|z|b|a, attention's
# q(+gate)|k|v, the output projections (GDN's and attention's share a shape), the MLP's gate|up
# and down, the LM head
SHAPES = {
    "gdn_in_proj": (2 * 2048 + 4096 + 4096 + 32 + 32, HIDDEN),
    "attn_qkv": (2 * 16 * 256 + 2 * 2 * 256, HIDDEN),
    "out_proj": (HIDDEN, 4096),
    "mlp_gate_up": (2 * INTERMEDIATE, HIDDEN),
    "mlp_down": (HIDDEN, INTERMEDIATE),
    "lm_head": (VOCAB, HIDDEN),
}
ROWS = (1, 9, 72, 576)
SWEEP = [(bm, bn, wp, st) for bm in (16, 64, 128) for bn in (64, 128, 256) for wp, st in ((4, 3), (8, 4)) if not (bm == 16 and wp == 8)]


def graph_ms(fn, repeats: int, launches: int = 20) -> float:
    """Median ms of one fn() replayed from a CUDA graph of `launches` calls."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / launches)
    return statistics.median(times)


def row_invariant(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Rows of every M-row product equal those of the 1024-row product and of each row alone."""
    full = linear(x, w)
    for m in ROWS:
        if not torch.equal(linear(x[:m], w), full[:m]):
            return False
    return all(torch.equal(linear(x[i : i + 1].clone(), w), full[i : i + 1]) for i in (0, 7, 100, 575, 1023))


def tiles_equal(x: torch.Tensor, w: torch.Tensor) -> tuple[int, int]:
    """(tiles giving the pinned tile's bits, tiles tried), on the pinned K walk (BLOCK_K kept). A
    tile whose pipeline does not fit in shared memory is not counted as tried."""
    n, k = w.shape
    pinned = linear_config(n, k, torch.bfloat16)
    want = linear(x, w, config=pinned)
    equal = tried = 0
    for bm, bn, wp, st in SWEEP:
        try:
            got = linear(x, w, config=pinned._replace(BLOCK_M=bm, BLOCK_N=bn, num_warps=wp, num_stages=st))
        except OutOfResources:
            continue
        tried += 1
        equal += torch.equal(got, want)
    return equal, tried


def bench_shape(name: str, n: int, k: int, repeats: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).bfloat16()
    x = torch.randn(max(1024, max(ROWS)), k, device="cuda", generator=gen).bfloat16()
    pinned = linear_config(n, k, torch.bfloat16)
    figures = {"N": n, "K": k, "split_k": pinned.SPLIT_K, "row_invariant": row_invariant(x, w)}
    equal, tried = tiles_equal(x[:576], w)
    figures["tiles_equal"] = f"{equal}/{tried}"
    figures["ok"] = figures["row_invariant"] and equal == tried
    figures["rows"] = {}
    for m in ROWS:
        xm = x[:m].contiguous()
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        ours = graph_ms(lambda: linear(xm, w, out=out), repeats)
        cublas = graph_ms(lambda: torch.matmul(xm, w.t(), out=out), repeats)
        flop = 2 * m * n * k
        tile = tile_for_rows(pinned, n, m, torch.bfloat16)
        figures["rows"][str(m)] = {"ours_ms": round(ours, 4), "cublas_ms": round(cublas, 4),
                                   "ours_tflops": round(flop / ours / 1e9, 1), "cublas_tflops": round(flop / cublas / 1e9, 1),
                                   "ours_over_cublas": round(cublas / ours, 3),
                                   "tile": [tile.BLOCK_M, tile.BLOCK_N, tile.BLOCK_K, tile.num_warps, tile.num_stages]}
    if not figures["ok"]:  # no timing reported when a gate is red
        figures["rows"] = None
    print(f"[gemm] {name} [{n}, {k}] split {pinned.SPLIT_K}: row-invariant {figures['row_invariant']}, tiles equal "
          f"{figures['tiles_equal']}; " + "; ".join(f"M {m}: {r['ours_tflops']} vs {r['cublas_tflops']} TF/s "
                                                   f"({r['ours_over_cublas']:.2f})" for m, r in (figures["rows"] or {}).items()),
          file=sys.stderr, flush=True)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gemm", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="directory for gemm_<date>.json")
    parser.add_argument("--repeats", type=int, default=20, help="timed graph replays per figure (the median is kept)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.gemm needs a CUDA device", file=sys.stderr)
        return 2
    shapes = {name: bench_shape(name, n, k, args.repeats) for name, (n, k) in SHAPES.items()}
    date = datetime.date.today().isoformat()
    result = {"device": device_name("cuda"), "date": date, "torch": torch.__version__, "triton": triton.__version__,
              "rows": list(ROWS), "shapes": shapes}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gemm_{date}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"[gemm] wrote {path}", file=sys.stderr)
    return 0 if all(s["ok"] for s in shapes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
