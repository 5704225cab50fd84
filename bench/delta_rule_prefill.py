"""Prefill's gated delta rule at a model's GDN shapes: the serial walk against the chunked form.
How it measures, what it checks and writes: bench/README.md, Methods, `bench.delta_rule_prefill`.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

from bench.gpu import median_ms
from bench.machine import NAME_HELP, device_name, name_arg, write_results
from hybrid_kernels import delta_rule_chunked as chunked_module
from hybrid_kernels.delta_rule import DeltaRuleConfig, delta_rule_config, delta_rule_verify, delta_rule_verify_ref
from hybrid_kernels.delta_rule_chunked import CHUNK, chunk_table, delta_rule_chunked, delta_rule_chunked_ref


def log(message: str) -> None:
    print(f"[delta_rule_prefill] {message}", file=sys.stderr, flush=True)


def inputs(rows: int, sequences: int, heads: int, d_k: int, d_v: int, device: torch.device, seed: int) -> dict:
    """One layer's prefill rows as GDN hands them to the delta rule: keys and queries l2-normalised,
    decays exp(g) in (0.5, 1), betas in (0, 1); `sequences` prompts of rows / sequences rows each,
    from position 0, over states of scale 0.1."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    per = rows // sequences
    return dict(query=torch.nn.functional.normalize(draw(rows, heads, d_k), dim=-1),
                key=torch.nn.functional.normalize(draw(rows, heads, d_k), dim=-1),
                value=draw(rows, heads, d_v),
                decay=0.5 + 0.5 * torch.rand(rows, heads, 1, generator=gen, device=device),
                beta=torch.rand(rows, heads, generator=gen, device=device),
                state=0.1 * draw(sequences, heads, d_k, d_v),
                seq_slots=torch.arange(sequences, dtype=torch.int32, device=device),
                cu_rows=torch.arange(0, sequences * per + 1, per, dtype=torch.int32, device=device),
                starts=torch.zeros(sequences, dtype=torch.int32, device=device),
                counts=[per] * sequences)


def measure(rows: int, sequences: int, args, device: torch.device) -> dict:
    t = inputs(rows, sequences, args.heads, args.d_k, args.d_v, device, args.seed)
    cuda = device.type == "cuda"
    serial_fn, chunked_fn = (delta_rule_verify, delta_rule_chunked) if cuda else (delta_rule_verify_ref, delta_rule_chunked_ref)
    dtype = torch.bfloat16 if cuda else torch.float32
    table = chunk_table([0] * sequences, t["counts"], args.chunk).to(device)
    walk = (t["query"], t["key"], t["value"], t["decay"], t["beta"], t["seq_slots"], t["cu_rows"])
    serial_state, chunked_state = t["state"].clone(), t["state"].clone()
    serial_out = torch.empty(rows, args.heads, args.d_v, dtype=dtype, device=device)
    chunked_out = torch.empty_like(serial_out)

    def serial():
        serial_fn(serial_state.copy_(t["state"]), *walk, out=serial_out, commit=True)

    def chunked():
        chunked_fn(chunked_state.copy_(t["state"]), *walk, t["starts"], chunked_out, chunk=args.chunk, table=table)

    serial_ms, chunked_ms = median_ms(serial, args.repeats, warmup=1), median_ms(chunked, args.repeats, warmup=1)
    serial()
    chunked()
    tiles = {}  # the serial walk in other tiles (delta_rule_verify's config): each must give the default's bits
    for block_v, warps in args.serial_tiles if cuda else ():
        config = DeltaRuleConfig(delta_rule_config(args.d_k, args.d_v).BLOCK_K, block_v, warps)
        tile_state, tile_out = t["state"].clone(), torch.empty_like(serial_out)

        def tiled():
            delta_rule_verify(tile_state.copy_(t["state"]), *walk, out=tile_out, config=config, commit=True)

        ms = median_ms(tiled, args.repeats, warmup=1)
        tiled()
        tiles[f"{block_v}x{warps}"] = {"ms": round(ms, 4), "x_default": round(ms / serial_ms, 3),
                                       "same_bits": bool(torch.equal(tile_state, serial_state) and torch.equal(tile_out, serial_out))}
    state_scale = serial_state.abs().max().item()
    default = delta_rule_config(args.d_k, args.d_v, sequences, rows)
    return {"rows": rows, "sequences": sequences, "serial_ms": round(serial_ms, 4), "chunked_ms": round(chunked_ms, 4),
            "serial_tile": f"{default.BLOCK_V}x{default.num_warps}", "serial_tiles": tiles,
            "chunked_x_serial": round(chunked_ms / serial_ms, 3),
            # the two forms round differently (fp32); what they must agree to is the tests' (tests/kernel_tests)
            "max_state_difference": (serial_state - chunked_state).abs().max().item(), "state_scale": state_scale,
            "max_out_difference": (serial_out.float() - chunked_out.float()).abs().max().item()}


def run(args) -> dict:
    device = torch.device(args.device)
    if args.chunked_precision is not None:
        chunked_module.DOT_PRECISION = args.chunked_precision
    result = {"device": device_name(device.type), "date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "heads": args.heads, "d_k": args.d_k, "d_v": args.d_v, "chunk": args.chunk, "repeats": args.repeats,
              "chunked_precision": chunked_module.DOT_PRECISION, "shapes": []}
    if device.type == "cuda":
        import triton

        result["triton"] = triton.__version__
    for sequences in args.sequences:
        for rows in args.rows:
            figure = measure(rows * sequences, sequences, args, device)
            tiles = ", ".join(f"{tile} {f['ms']:.3f} ms{'' if f['same_bits'] else ' OTHER BITS'}" for tile, f in figure["serial_tiles"].items())
            log(f"{sequences} x {rows} rows: serial {figure['serial_ms']:.3f} ms ({figure['serial_tile']}), chunked "
                f"{figure['chunked_ms']:.3f} ms ({figure['chunked_x_serial']:.2f}x)" + (f"; serial in other tiles: {tiles}" if tiles else ""))
            result["shapes"].append(figure)
    return result


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder of the results JSON")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, nargs="+", default=[512, 2048, 8192], help="rows of each prompt (one layer's walk)")
    parser.add_argument("--sequences", type=int, nargs="+", default=[1, 8], help="prompts walked together")
    parser.add_argument("--heads", type=int, default=32, help="value heads (Qwen3.6-35B-A3B: 32)")
    parser.add_argument("--d-k", type=int, default=128)
    parser.add_argument("--d-v", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=CHUNK, help="the chunked form's sub-chunk rows")
    parser.add_argument("--repeats", type=int, default=5, help="timed walks per figure (median)")
    parser.add_argument("--serial-tiles", type=_tiles, default=(), metavar="BLOCK_VxWARPS,...",
                        help="on CUDA, also time the serial walk in these tiles (e.g. 8x1,16x2,32x4), each checked for the "
                             "default tile's bits (recorded per shape as serial_tiles)")
    parser.add_argument("--chunked-precision", choices=("ieee", "tf32x3"), default=None,
                        help="the chunked form's products (kernels/delta_rule_chunked.py's DOT_PRECISION; None: its default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="", type=name_arg, help=NAME_HELP)
    return parser.parse_args(argv)


def _tiles(text: str) -> tuple[tuple[int, int], ...]:
    """'8x1,16x2' -> ((8, 1), (16, 2)): value columns a tile and its warps, each a power of two."""
    tiles = []
    for part in text.split(","):
        try:
            block_v, warps = (int(n) for n in part.split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"a tile is BLOCK_VxWARPS (e.g. 16x2), got {part!r}") from None
        if block_v < 1 or warps < 1 or block_v & (block_v - 1) or warps & (warps - 1):
            raise argparse.ArgumentTypeError(f"a tile's columns and warps are powers of two, got {part!r}")
        tiles.append((block_v, warps))
    return tuple(tiles)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log(f"wrote {write_results(args.out, 'delta_rule_prefill', run(args), args.name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
