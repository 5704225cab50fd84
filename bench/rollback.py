"""Snapshot versus write-on-accept rollback: bytes moved and time per verify.
How it measures, what it checks and writes: bench/README.md, Methods, `bench.rollback`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.machine import device_name
from verifier.arguments import DefaultsHelpFormatter, at_least
from verifier.engine import Engine, StepRequest
from verifier.model import RowBatch, load_model
from verifier.model.random_checkpoint import write_random_checkpoint
from verifier.model.rollback import ROLLBACK_MODES
from verifier.model.step import verify
from verifier.model.state import RecurrentState
from verifier.params import SamplingParams

SIZES = [  # (value heads, d_k = d_v): the last is Qwen3-Next's GDN layer
    (4, 32),
    (16, 64),
    (32, 128),
]
KS = (4, 8)
HIDDEN = 64
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def _config(heads: int, dim: int) -> dict:
    return {
        "model_type": "qwen3_5_text", "vocab_size": 64, "hidden_size": HIDDEN, "intermediate_size": 64,
        "num_hidden_layers": 1, "layer_types": ["linear_attention"], "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 16, "linear_num_key_heads": heads // 2, "linear_num_value_heads": heads,
        "linear_key_head_dim": dim, "linear_value_head_dim": dim, "linear_conv_kernel_dim": 4,
    }


def _state(engine: Engine, slot: int) -> list[torch.Tensor]:
    return [t for layer in engine.pool.layers if isinstance(layer, RecurrentState)
            for t in (layer.conv[slot].clone(), engine.rollback.committed_state(engine.pool, layer, slot))]


def _serial(model, k: int, device) -> tuple[list[int], list[torch.Tensor]]:
    engine = Engine(model, 1, 64)
    seq = engine.open(PROMPT, SamplingParams(), k + 2, eos_ids=())
    tokens, states = [seq.pending], [_state(engine, seq.slot)]
    while not seq.finished:
        (res,) = engine.step([StepRequest(seq, [])])
        tokens += res.tokens
        states.append(_state(engine, seq.slot))
    return tokens, states


def _bytes(heads: int, dim: int, k: int, a: int, mode: str) -> dict:
    state = heads * dim * dim * 4
    stash_row = heads * (dim + dim + 1 + 1) * 4  # key, value, decay (GDN: one per head), beta
    if mode == "snapshot":
        verify, fold = state + (k + 1) * state, 2 * state
    else:
        verify, fold = state + (k + 1) * stash_row, (a + 1) * stash_row + 2 * state
    return {"verify_bytes": verify, "rollback_bytes": fold, "total_bytes": verify + fold}


def measure(heads: int, dim: int, device: str, repeats: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        write_random_checkpoint(_config(heads, dim), tmp, seed=1)
        model = load_model(tmp, device)
    rows = []
    for k in KS:
        a = k // 2
        serial_tokens, serial_states = _serial(model, k, device)
        drafts = serial_tokens[1 : k + 1]
        drafts[a] = (drafts[a] + 1) % 64  # reject at row a: a drafts accepted
        for mode in ROLLBACK_MODES:
            engine = Engine(model, 1, 64, max_k=0, rollback_mode=mode)  # max_k 0: a pool that folds (module docstring)
            verify_ms, rollback_ms = [], []
            for _ in range(repeats):
                seq = engine.open(PROMPT, SamplingParams(), 64, eos_ids=())
                batch = RowBatch((seq.slot,), (seq.position,), (k + 1,))
                tokens = torch.tensor([seq.pending, *drafts])
                _sync(device)
                t0 = time.perf_counter()
                step = verify(model, engine.pool, tokens, batch, engine.rollback)
                _sync(device)
                t1 = time.perf_counter()
                step.rollback([a + 1])
                _sync(device)
                t2 = time.perf_counter()
                verify_ms.append((t1 - t0) * 1e3)
                rollback_ms.append((t2 - t1) * 1e3)
                assert all(torch.equal(x, y) for x, y in zip(_state(engine, seq.slot), serial_states[a + 1])), f"{mode}: state differs from serial"
                engine.close(seq)
            rows.append({
                "heads": heads, "d_k": dim, "d_v": dim, "state_mib": heads * dim * dim * 4 / 2**20, "k": k, "accepted": a, "mode": mode,
                "verify_ms": statistics.median(verify_ms), "rollback_ms": statistics.median(rollback_ms),
                "state_equal_serial": True, **_bytes(heads, dim, k, a, mode),
            })
            print(f"H={heads:>2} d={dim:>3} K={k} a={a} {mode:>8}: verify {rows[-1]['verify_ms']:8.2f} ms, rollback {rows[-1]['rollback_ms']:7.3f} ms, "
                  f"state traffic {rows[-1]['total_bytes'] / 2**20:7.2f} MiB")
    return rows


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.rollback", description=__doc__.split("\n")[0],
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the torch reference runs")
    parser.add_argument("--repeats", type=at_least(1), default=21, help="timed runs per figure; the median is reported")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = [r for heads, dim in SIZES for r in measure(heads, dim, args.device, args.repeats)]
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    today = datetime.date.today().isoformat()
    out = {
        "benchmark": "rollback", "device": device_name(args.device), "backend": "torch reference", "date": today,
        "torch": torch.__version__, "triton": triton_version, "repeats": args.repeats, "rows": rows,
    }
    path = Path(__file__).resolve().parent / "results" / f"rollback_{today}.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
