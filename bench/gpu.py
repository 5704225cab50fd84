"""GPU verify cost on one device: decode, K-row verify, rollback, bit-exactness, and HF + FLA beside it.
How it measures, what it checks and writes: bench/README.md, Methods, `bench.gpu`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.gemm import model_gemm
from hybrid_kernels import dependent_launch
from presets.bench_models import MODELS
from verifier.engine import Engine, StepRequest
from verifier.model import RowBatch, load_model
from verifier.model.fp8 import BlockFP8Weight, OutFeatureGroups
from verifier.model.rollback import SNAPSHOT, WOA
from verifier.model.state import RecurrentState, SlotPool
from verifier.model.step import verify
from verifier.params import SamplingParams

PROMPT_LEN = 64
KS = (1, 2, 4, 8, 16)
GEMM_REPEATS = 10  # graph replays (of 20 launches) per GEMM figure: the section's GPU time stays a few seconds per model


def sync() -> None:
    """Wait for the GPU's queued work (nothing to wait for without one: CPU runs time their own ops)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_ms(fn, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy of 2 GiB: bytes read + written per second."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), 10)
    return 2 * (2 << 30) / (ms / 1e3)


def build_checkpoint(family: str, fields: dict, out: Path) -> None:
    import transformers as tf

    classes = {
        "qwen3_5_text": (tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM),
        "qwen3_next": (tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM),
        "kimi_linear": (tf.KimiLinearConfig, tf.KimiLinearForCausalLM),
    }
    config_cls, model_cls = classes[family]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = model_cls(config_cls(**fields)).to(torch.bfloat16)
    model.save_pretrained(out)
    del model
    gc.collect()
    torch.cuda.empty_cache()


def weight_bytes(weight) -> int:
    """Bytes a GEMM reads from a weight: a tensor; a BlockFP8Weight (fp8 values, block scales,
    scale rows: its nbytes); an OutFeatureGroups (its groups, FP8 beside kept bf16)."""
    if isinstance(weight, OutFeatureGroups):
        return sum(weight_bytes(group) for group in weight.groups)
    if isinstance(weight, BlockFP8Weight):
        return weight.nbytes
    return weight.numel() * weight.element_size()


def expert_bytes(stacked) -> int:
    """Bytes of one expert in a stacked expert weight [E, N, K]: its slice, and of an FP8 stack its
    block scales [S, ceil(K / block_k)] and the scale rows [N] every expert shares."""
    if isinstance(stacked, BlockFP8Weight):
        s = stacked.scales
        return weight_bytes(stacked.data[0]) + weight_bytes(s.scale_inv[0]) + weight_bytes(s.scale_row)
    return weight_bytes(stacked[0])


def layer_expert_bytes(mlp) -> int:
    """Bytes of one routed expert of a MoE layer: its gate, up and down weights (expert_bytes)."""
    return sum(expert_bytes(w) for w in (mlp.w_gate, mlp.w_up, mlp.w_down))


def decode_bytes(model) -> int:
    """Weights one single-row decode step reads: everything but the unchosen experts and the
    embedding table (one row of it; a tied table is read whole as the LM head). FP8 weights count
    their fp8 bytes and scales."""
    total = 0
    cfg = model.config
    for block in model.blocks:
        for value in list(vars(block.mixer).values()) + [block.input_norm, block.post_norm]:
            if isinstance(value, (torch.Tensor, BlockFP8Weight, OutFeatureGroups)):
                total += weight_bytes(value)
        mlp = block.mlp
        if hasattr(mlp, "w_router"):
            # a folded shared expert is one more expert every row reads (verifier/model/layers/mlp.py)
            total += (cfg.moe.top_k + mlp.shared_folded) * layer_expert_bytes(mlp) + weight_bytes(mlp.w_router)
            if mlp.shared is not None:
                total += weight_bytes(mlp.shared.w_gate_up) + weight_bytes(mlp.shared.w_down)
            if hasattr(mlp, "w_shared_gate"):
                total += weight_bytes(mlp.w_shared_gate)
        else:
            total += weight_bytes(mlp.w_gate_up) + weight_bytes(mlp.w_down)
    return total + weight_bytes(model.lm_head) + weight_bytes(model.final_norm)


def batch_state_bytes(pool: SlotPool, n_sequences: int, position: int) -> int:
    """Bytes a decode step of n_sequences at `position` must move besides the weights: per sequence,
    each recurrent layer's state and conv window read and written once, each attention layer's keys
    and values of positions 0 .. position read and one position written. With decode_bytes, the HBM
    floor of a batch decode: at 64 sequences the 2B model's fp32 recurrent states alone (2 MiB a
    layer and sequence) outweigh its weights."""
    per_sequence = 0
    for layer in pool.layers:
        if isinstance(layer, RecurrentState):
            per_sequence += 2 * sum(t[0].numel() * t.element_size() for t in (layer.recurrent, layer.conv))
        else:
            per_position = sum(t[0, 0].numel() * t.element_size() for t in (layer.keys, layer.values))
            per_sequence += per_position * (position + 2)
    return n_sequences * per_sequence


def open_sequences(engine: Engine, n: int) -> list:
    gen = torch.Generator().manual_seed(1)
    return [engine.open(torch.randint(3, 1000, (PROMPT_LEN,), generator=gen).tolist(), SamplingParams(), 10_000, eos_ids=()) for _ in range(n)]


def bitexact_rows(model, k: int = 8, steps: int = 4) -> tuple[int, int]:
    """Serial decode vs one K-row verify of the serial continuation: rows bitwise equal / rows."""
    engine = Engine(model, 2, PROMPT_LEN + steps * (k + 1) + 8, max_k=k)
    serial_seq, spec_seq = open_sequences(engine, 1)[0], None
    serial_tokens, serial_rows = [serial_seq.pending], []
    for _ in range(steps * (k + 1)):
        (res,) = engine.step([StepRequest(serial_seq, [])])
        serial_tokens += res.tokens
        serial_rows.append(res.logits[0])
    engine.close(serial_seq)
    spec_seq = open_sequences(engine, 1)[0]
    equal = total = 0
    emitted = 1
    for _ in range(steps):
        drafts = serial_tokens[emitted : emitted + k]
        (res,) = engine.step([StepRequest(spec_seq, drafts)])
        for i, row in enumerate(res.logits):
            total += 1
            equal += int(torch.equal(row, serial_rows[emitted - 1 + i]))
        emitted += len(res.tokens)
    engine.close(spec_seq)
    return equal, total


def rejected_step(engine: Engine, seqs: list, k: int) -> None:
    """One engine step (verify + acceptance + rollback) of `seqs` with K drafts each that are all rejected."""
    vocab = engine.vocab_size
    engine.step([StepRequest(s, [(s.pending + 1 + i) % vocab for i in range(k)]) for s in seqs])


def step_ms(engine: Engine, seqs: list, k: int, repeats: int) -> float:
    """The median ms of rejected_step."""
    return median_ms(lambda: rejected_step(engine, seqs, k), repeats)


def rollback_figures(model, k: int, repeats: int) -> dict:
    """Verify of K+1 rows, then rollback to a = K/2 accepted, timed apart (CUDA-graphed when the engine graphs).
    A write-on-accept engine carries the kept rows into the next verify (verifier/model/rollback.py):
    its rollback copies them, and each verify timed applies the last rollback's a + 1 rows first,
    so the fold's work is in verify_ms ('carries': True)."""
    out = {}
    for mode in (WOA, SNAPSHOT):
        engine = Engine(model, 1, PROMPT_LEN + 64, max_k=k, rollback_mode=mode, graph_rows=(k + 1,))
        engine.warm_up()
        seq = open_sequences(engine, 1)[0]
        batch = RowBatch((seq.slot,), (seq.position,), (k + 1,))
        tokens = torch.arange(k + 1) + 5
        verify_ms, rollback_ms = [], []
        for _ in range(repeats + 2):
            sync()
            t0 = time.perf_counter()
            step = engine.runner.step(tokens, batch)
            step.verify()
            sync()
            t1 = time.perf_counter()
            step.rollback([k // 2 + 1])
            sync()
            t2 = time.perf_counter()
            verify_ms.append((t1 - t0) * 1e3)
            rollback_ms.append((t2 - t1) * 1e3)
        out[mode] = {"verify_ms": statistics.median(verify_ms[2:]), "rollback_ms": statistics.median(rollback_ms[2:]),
                     "carries": engine.pool.carry_rows > 0}
    out["k"], out["accepted"] = k, k // 2
    return out


def step_timeline(engine: Engine, seqs: list, k: int, steps: int = 10) -> dict:
    """Where a graphed engine step's wall time goes (the step step_ms times, under the profiler):
    per step its wall ms, the ms the GPU was busy (the union of the step's kernels and copies on the
    device timeline) and the span from the first to the last of them. wall - busy is host work and
    the gaps between graph nodes. The profiler widens the gaps and the wall (its own host work sits
    between the nodes), so compare its figures with each other, never with step_ms's unprofiled ones."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    rejected_step(engine, seqs, k)
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            rejected_step(engine, seqs, k)
        sync()
        wall = time.perf_counter() - start
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA)
    busy, reach = 0.0, float("-inf")  # us: the union of the intervals, walked in start order
    for first, last in spans:
        busy += max(0.0, last - max(first, reach))
        reach = max(reach, last)
    return {"wall_ms": wall / steps * 1e3, "device_busy_ms": busy / steps / 1e3,
            "device_span_ms": (spans[-1][1] - spans[0][0]) / steps / 1e3 if spans else 0.0, "device_events": len(spans)}


def figures_in_turns(model, settings: dict, ks: dict[str, int], steps: int, alternations: int = 6) -> dict:
    """Batch-1 engine steps under each setting (settings: tag -> a context manager factory, entered
    while its engine is made, warmed up and captured): one engine per setting, timed in turns in
    this process (this host's drift between runs is larger than the differences timed). ks: figure
    name -> drafts K. -> {name_tag_ms: median of the alternations' medians, runs_ms: every median}."""
    rows = max(ks.values()) + 1
    engines = {}
    for tag, setting in settings.items():
        with setting():
            # every timed or warm-up step advances the sequence one position (rejected_step)
            engine = Engine(model, 1, PROMPT_LEN + 2 * alternations * len(ks) * (steps + 3) + 16, max_k=rows - 1,
                            graph_rows=tuple(sorted({k + 1 for k in ks.values()})))
            engine.warm_up()
            engines[tag] = (engine, open_sequences(engine, 1))
    runs = {f"{name}_{tag}": [] for name in ks for tag in settings}
    for _ in range(alternations):
        for tag, (engine, seqs) in engines.items():
            for name, k in ks.items():
                runs[f"{name}_{tag}"].append(step_ms(engine, seqs, k, steps))
    out = {f"{key}_ms": statistics.median(values) for key, values in runs.items()}
    out["runs_ms"] = runs
    return out


@contextlib.contextmanager
def pdl_setting(on: bool):
    """Launches with programmatic dependent launch on or off (VERIFIER_PDL, a per-process switch)."""
    before = os.environ.get("VERIFIER_PDL")
    os.environ["VERIFIER_PDL"] = "1" if on else "0"
    dependent_launch._options.cache_clear()  # read again for this setting's captures
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("VERIFIER_PDL", None)
        else:
            os.environ["VERIFIER_PDL"] = before
        dependent_launch._options.cache_clear()


def pdl_figures(model, steps: int, alternations: int = 6) -> dict:
    """The batch-1 decode and K = 8 steps with programmatic dependent launch (kernels/dependent_launch.py)
    and without it, timed in turns."""
    return figures_in_turns(model, {"pdl": lambda: pdl_setting(True), "no_pdl": lambda: pdl_setting(False)},
                            {"decode": 0, "verify8": 8}, steps, alternations)


def kernel_breakdown(model, k: int) -> list[dict]:
    """GPU time per kernel name for one eager verify of K+1 rows (graphs replay the same kernels)."""
    engine = Engine(model, 1, PROMPT_LEN + 64, max_k=k, cuda_graphs=False)
    seq = open_sequences(engine, 1)[0]
    batch = RowBatch((seq.slot,), (seq.position,), (k + 1,))
    tokens = torch.arange(k + 1) + 5
    verify(model, engine.pool, tokens, batch)
    sync()
    return kernel_table(lambda: verify(model, engine.pool, tokens, batch))


def kernel_table(fn, top: int = 15) -> dict:
    """GPU time per kernel name of one call of fn (run once before, unprofiled, by the caller):
    launches and device ms of its kernels (copies and memsets apart), and the `top` rows by device
    time, each with its share of the kernels' GPU time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if device_us > 0:
            rows.append({"kernel": event.key[:80], "calls": event.count, "device_ms": device_us / 1e3})
    rows.sort(key=lambda r: -r["device_ms"])
    kernels = [r for r in rows if not r["kernel"].startswith(("cudaGraph", "Memcpy", "Memset"))]
    device_ms = sum(r["device_ms"] for r in kernels)
    for r in rows:
        r["share"] = r["device_ms"] / device_ms if device_ms else None
    sort_topk = sum(r["calls"] for r in kernels if any(word in r["kernel"].lower() for word in ("sort", "topk")))
    return {"launches": sum(r["calls"] for r in kernels), "copies_and_sets": sum(r["calls"] for r in rows if r not in kernels),
            "sort_topk_launches": sort_topk, "device_ms": device_ms, "top": rows[:top]}


def hf_figures(path: Path, repeats: int) -> dict:
    import transformers as tf

    try:
        import fla  # noqa: F401

        fla_version = getattr(fla, "__version__", "present")
    except ImportError:
        fla_version = None
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda").eval()
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 1000, (1, PROMPT_LEN), generator=gen).cuda()
    drafts = torch.randint(3, 1000, (1, 8), generator=gen).cuda()

    def prefill():
        cache = tf.DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=prompt, past_key_values=cache, use_cache=True)
        return cache

    with torch.no_grad():
        cache = prefill()
        token = drafts[:, :1]
        decode = median_ms(lambda: model(input_ids=token, past_key_values=cache, use_cache=True), repeats)
        forward8 = []
        for _ in range(repeats):
            c = prefill()
            sync()
            t0 = time.perf_counter()
            model(input_ids=drafts, past_key_values=c, use_cache=True)
            sync()
            forward8.append((time.perf_counter() - t0) * 1e3)
        c = prefill()
        rows8 = model(input_ids=drafts, past_key_values=c, use_cache=True).logits[0].float()
        c = prefill()
        serial = torch.stack([model(input_ids=drafts[:, i : i + 1], past_key_values=c, use_cache=True).logits[0, -1].float() for i in range(8)])
    equal = sum(int(torch.equal(a, b)) for a, b in zip(rows8, serial))
    model = None  # freed before the cache is emptied (prefill's closure holds the name too)
    gc.collect()
    torch.cuda.empty_cache()
    return {"fla": fla_version, "hf_decode_ms": decode, "hf_verify8_ms": statistics.median(forward8), "hf_verify8_rows_equal_serial": equal}


def bench_model(name: str, family: str, fields: dict, bandwidth: float, steps: int, workdir: Path, with_hf: bool = True,
                with_pdl: bool = False) -> dict:
    path = workdir / name
    t0 = time.perf_counter()
    build_checkpoint(family, fields, path)
    model = load_model(path, "cuda", torch.bfloat16)
    params = checkpoint_params(path)
    print(f"[{name}] built and loaded in {time.perf_counter() - t0:.0f} s: {params / 1e9:.2f} B parameters", flush=True)
    floor_bytes = decode_bytes(model)
    result = {"family": family, "model_params": params, "decode_weight_bytes": floor_bytes, "hbm_floor_ms": floor_bytes / bandwidth * 1e3}

    equal, total = bitexact_rows(model)
    result["bitexact_rows_equal"], result["bitexact_rows_total"] = equal, total
    print(f"[{name}] bitexact: {equal}/{total} verify rows equal serial decode", flush=True)
    if equal != total:
        print(f"[{name}] NOT BITEXACT: timings below are reported but the correctness gate is red", flush=True)

    engine = Engine(model, 64, PROMPT_LEN + 2 * steps * 20 + 64, max_k=16)
    engine.warm_up()  # every graph bucket captured here, outside the timed steps
    one = open_sequences(engine, 1)
    result["decode_ms"] = step_ms(engine, one, 0, steps)
    result["verify_ms"] = {str(k): step_ms(engine, one, k, steps) for k in KS}
    print(f"[{name}] decode {result['decode_ms']:.2f} ms (floor {result['hbm_floor_ms']:.2f}); verify {result['verify_ms']}", flush=True)
    batch = {}
    for n in (8, 64):
        for s in one:
            engine.close(s)
        one = open_sequences(engine, n)
        batch[str(n)] = {"decode_ms": step_ms(engine, one, 0, max(5, steps // 3)), "verify8_ms": step_ms(engine, one, 8, max(5, steps // 3)),
                         "hbm_floor_ms": (floor_bytes + batch_state_bytes(engine.pool, n, PROMPT_LEN)) / bandwidth * 1e3}
        print(f"[{name}] batch {n}: {batch[str(n)]}", flush=True)
    result["batch"] = batch
    for s in one:
        engine.close(s)
    try:  # the batch-1 decode and K = 8 steps as timed above, split into GPU-busy time and the rest
        one = open_sequences(engine, 1)
        result["step_timeline"] = {f"k{k}": step_timeline(engine, one, k) for k in (0, 8)}
        print(f"[{name}] step timeline: {result['step_timeline']}", flush=True)
    except Exception as exc:
        result["step_timeline_error"] = f"{type(exc).__name__}: {exc}"
    if with_pdl:  # one model's A/B is enough: PDL changes no kernel's work
        result["pdl"] = pdl_figures(model, steps)
        print(f"[{name}] PDL on and off: { {k: v for k, v in result['pdl'].items() if k != 'runs_ms'} }", flush=True)
    result["rollback"] = rollback_figures(model, 8, steps)
    print(f"[{name}] rollback: {result['rollback']}", flush=True)
    result["graphed"] = engine.graphed
    result["graph_captures"] = engine.graph_captures
    try:
        result["kernel_breakdown_k0"] = kernel_breakdown(model, 0)
        result["kernel_breakdown_k8"] = kernel_breakdown(model, 8)
        print(f"[{name}] kernels (K=8): {result['kernel_breakdown_k8']['launches']} launches, "
              f"{result['kernel_breakdown_k8']['device_ms']:.2f} ms; top {result['kernel_breakdown_k8']['top'][:6]}", flush=True)
    except Exception as exc:
        result["kernel_breakdown_error"] = f"{type(exc).__name__}: {exc}"
    try:  # our GEMM against cuBLAS on this model's weights; no timing where a gate is red
        red = None if equal == total else f"the model's bitexact gate is red: {equal}/{total} verify rows equal serial decode"
        result["gemm"] = model_gemm(model, GEMM_REPEATS, untimed=red)
        print(f"[{name}] gemm: {len(result['gemm']['shapes'])} weight shapes, all row-invariant {result['gemm']['all_row_invariant']}; "
              f"skipped {result['gemm']['skipped']}", flush=True)
    except Exception as exc:
        result["gemm_error"] = f"{type(exc).__name__}: {exc}"
    del engine, model
    gc.collect()
    torch.cuda.empty_cache()
    if not with_hf:
        return result
    try:
        result.update(hf_figures(path, max(5, steps // 3)))
    except Exception as exc:  # the comparison must not hide our own figures
        result["hf_error"] = f"{type(exc).__name__}: {exc}"
    print(f"[{name}] HF: { {k: v for k, v in result.items() if k.startswith('hf') or k == 'fla'} }", flush=True)
    return result


def checkpoint_params(path: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                n = 1
                for d in f.get_slice(name).get_shape():
                    n *= d
                total += n
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--no-hf", action="store_true", help="skip the HF transformers comparison")
    args = parser.parse_args()
    import triton

    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    today = datetime.date.today().isoformat()
    out = {"device": torch.cuda.get_device_name(), "date": today, "torch": torch.__version__, "triton": triton.__version__,
           "hbm_copy_bandwidth_bytes_per_s": bandwidth, "backend": "triton kernels, CUDA graphs per bucket of row counts", "models": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gpu_{today}.json"
    first_name = args.models.split(",")[0]
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            family, fields = MODELS[name]
            out["models"][name] = bench_model(name, family, fields, bandwidth, args.steps, Path(tmp), not args.no_hf, name == first_name)
            for key in ("model_params", "hbm_floor_ms", "decode_ms", "verify_ms", "batch", "rollback", "hf_decode_ms", "hf_verify8_ms",
                        "bitexact_rows_equal", "bitexact_rows_total", "graphed"):
                out[key] = out["models"][first_name].get(key)
            path.write_text(json.dumps(out, indent=2) + "\n")  # after each model: a time-out keeps what ran
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
