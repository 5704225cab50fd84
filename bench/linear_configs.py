"""Measure candidate launch configs of the row-invariant GEMM on the 2B checkpoint's weight shapes.

    python -m bench.linear_configs --out DIR

For every (N, K) projection of the Qwen3.5-style 2B model in bf16 and every candidate
(BLOCK_N, BLOCK_K, num_warps, num_stages): row invariance is checked first (1 row == row 0 of 9,
torch.equal), then the median time at 1 and 9 rows and the achieved weight bandwidth. Writes
DIR/linear_configs_<date>.json; kernels/linear.py pins its configs from these figures.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
from pathlib import Path

import torch

from hybrid_kernels.linear import LinearConfig, linear, linear_config
from presets.bench_models import DENSE_2B, weight_shapes
from verifier.arguments import DefaultsHelpFormatter

SHAPES = weight_shapes(DENSE_2B)  # name: (N, K), the 2B model's weights
CANDIDATES = [LinearConfig(n, k, w, s) for n, k, w, s in itertools.product((16, 32, 64, 128), (64, 128, 256), (4, 8), (3, 4, 6))
              if not (n == 128 and k == 256 and s == 6)]


def time_ms(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.linear_configs", description=__doc__.splitlines()[0],
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="directory for linear_configs_<date>.json")
    args = parser.parse_args()
    import triton

    torch.manual_seed(0)
    results = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        x = torch.randn(9, k, device="cuda", dtype=torch.bfloat16)
        one = x[:1].clone()
        pinned = linear_config(n, k, torch.bfloat16)
        rows = []
        for cfg in CANDIDATES:
            try:
                invariant = torch.equal(linear(one, w, config=cfg), linear(x, w, config=cfg)[:1])
                t1 = time_ms(lambda: linear(one, w, config=cfg))
                t9 = time_ms(lambda: linear(x, w, config=cfg))
            except Exception as exc:  # out of shared memory or registers: not a candidate
                rows.append({"config": cfg._asdict(), "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
                continue
            rows.append({"config": cfg._asdict(), "row_invariant": invariant, "ms_1": t1, "ms_9": t9,
                         "tb_per_s_1": n * k * 2 / t1 / 1e9})
        ok = [r for r in rows if r.get("row_invariant")]
        best = min(ok, key=lambda r: r["ms_1"] + r["ms_9"])
        pinned_row = next((r for r in ok if r["config"] == pinned._asdict()), None)
        print(f"{name} {n}x{k}: best {best['config']} {best['ms_1']:.4f}/{best['ms_9']:.4f} ms "
              f"({best['tb_per_s_1']:.2f} TB/s); pinned {pinned._asdict()} "
              f"{pinned_row and round(pinned_row['ms_1'], 4)}/{pinned_row and round(pinned_row['ms_9'], 4)}", flush=True)
        results.append({"name": name, "n": n, "k": k, "best": best, "pinned": pinned_row, "candidates": rows})
    today = datetime.date.today().isoformat()
    out = {"device": torch.cuda.get_device_name(), "date": today, "torch": torch.__version__, "triton": triton.__version__,
           "dtype": "bfloat16", "shapes": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"linear_configs_{today}.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
