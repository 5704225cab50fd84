"""Real size in block FP8 on one device: a published Qwen3.5-MoE config at full size, written as
its published -FP8 checkpoint with random weights, served through the normal loader, gated, timed.
How it measures, what it checks and writes: bench/README.md, Methods, `bench.fp8_real_size`.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import math
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.fp8_mtp import mtp_draft
from bench.gpu import PROMPT_LEN, bitexact_rows, copy_bandwidth, decode_bytes, kernel_table, median_ms, open_sequences, rejected_step
from bench.machine import device_name, name_arg, results_path
from bench.step_floor import SequenceStep, distinct_experts, mean_floor, model_sizes, recorded_routing, step_floor
from presets.published import PUBLISHED
from verifier.check.checks import CheckSettings, full_batch_vs_alone
from verifier.engine import Engine
from verifier.model import load_model
from verifier.model.config import ATTENTION, GDN, ModelConfig
from verifier.model.fp8 import FP8_DTYPE, FP8_MAX, BlockFP8Format, BlockFP8Weight, OutFeatureGroups
from verifier.model.fp8_checkpoint import INDEX, is_quantized
from verifier.model.hf_config import config_from_dict

PREFIX = "model.language_model."
# Modules the published -FP8 files keep in bf16 beside the embeddings and the head (matched as
# suffixes, as transformers matches them): routers, the shared-expert gate, GDN's b and a inputs,
# and the MTP head's fc (an extraction of the published Qwen3.6-35B-A3B-FP8 head reports it bf16;
# not verified here, and the loader reads either).
KEPT_MODULES = ("lm_head", PREFIX + "embed_tokens", "mlp.gate", "mlp.shared_expert_gate", "linear_attn.in_proj_a", "linear_attn.in_proj_b",
                "mtp.fc")
FORMAT = BlockFP8Format(128, 128, KEPT_MODULES)
FP8_SPREAD = FP8_MAX / 4  # std of the drawn fp8 values
K = 8
BATCH = 64
# the gate's full batch: BATCH sequences, prompts of 16..23 tokens, 12 tokens each, K up to 8
FULL_BATCH = CheckSettings(max_k=K, prompt_len=16, new_tokens=12, sequences=BATCH, seed=0)
WARMUP = 3  # untimed steps before each figure's timed ones
# drafts of the batch-1 verifies an MTP drafter pairs with (bench/fp8_mtp.py's MTP_KS), beside K
MTP_VERIFY_KS = (1, 2, 3, 4)
# the timed figures: (sequences, drafts K, results key), in the order they are timed
FIGURES = tuple((n, k, f"decode_ms_b{n}" if k == 0 else f"verify_k{k}_ms_b{n}")
                for n, ks in ((1, (0, *MTP_VERIFY_KS, K)), (BATCH, (0, K))) for k in ks)
BUCKETS = tuple(sorted({n * (k + 1) for n, k, _ in FIGURES}))  # one graph bucket per timed shape: no padding rows
# figures timed on CUDA only, after a green gate (None otherwise)
TIMED = ("hbm_floor_ms", *(key for _, _, key in FIGURES), "gpu_memory_gib", "kernel_breakdowns")
# An assumption, not a measurement (the checkpoint's weights are random): the mean acceptance length
# (tokens a verify step emits, the bonus counted) of the published Qwen3.5/3.6 MTP heads at K = 1, 2, 3
# drafts, from which `per_token` states the time per output token at one request
PUBLISHED_MTP_ACCEPTANCE = {1: 1.9, 2: 2.4, 3: 2.8}
# kernels/linear_fp8.py's and kernels/moe_grouped.py's launches, as the profiler names them
# (below kernels/linear_fp8.DEQUANTIZED_ROWS rows; above, the weight is dequantized by
# DEQUANTIZE_KERNEL and multiplied by kernels/linear.py's bf16 GEMM, whose launches the profiler
# names as those of the bf16 weights: no FP8 GEMM figure is read from such a table)
FP8_GEMM_KERNELS = ("_linear_fp8_kernel", "_linear_fp8_rows_kernel")
DEQUANTIZE_KERNEL = "_dequantize_kernel"
EXPERT_KERNELS = ("_grouped_hidden_kernel", "_grouped_down_kernel")
MTP = "mtp."  # the MTP head's tensors, as the published files name them

# --scale tiny: sizes only (every other field as published); partial 128-blocks everywhere, and
# the fused gate | up split (I = 160) inside a block row. Vocabulary past the bench prompts' ids (< 1000).
TINY_TEXT_SIZES = dict(
    vocab_size=1024, hidden_size=64, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=160,
    shared_expert_intermediate_size=160,  # the experts' width, as published: the shared expert is folded in as theirs
)
TINY_MROPE_SECTION = [2, 1, 1]  # the rotary half-width int(32 * 0.25) / 2, as [11, 11, 10] is at head_dim 256

# how a tensor's values are drawn
LINEAR, EMBED, NORM, GATED_NORM, A_LOG, DT_BIAS = "linear", "embed", "norm", "gated_norm", "A_log", "dt_bias"


def log(message: str) -> None:
    print(f"[fp8_real_size] {message}", file=sys.stderr, flush=True)


def published_configs() -> dict[str, dict]:
    """{lower-case name: config.json} of the published configs (presets/published.py)."""
    return {name.lower(): config for name, config in PUBLISHED.items()}


def checkpoint_config(name: str, scale: str) -> dict:
    """The published config.json (shrunk for --scale tiny) with the block-FP8 quantization_config."""
    config = json.loads(json.dumps(published_configs()[name]))  # a deep copy
    if scale == "tiny":
        config["text_config"].update(json.loads(json.dumps(TINY_TEXT_SIZES)))
        config["text_config"]["rope_parameters"]["mrope_section"] = list(TINY_MROPE_SECTION)
    return {**config, "quantization_config": FORMAT.to_config()}


@dataclass(frozen=True)
class Planned:
    """One tensor of the checkpoint. name: as stored; an expert stack [E, N, K] stored per expert
    has "{e}" in its name. fp8: float8_e4m3fn beside `<name>_scale_inv`, else stored in dtype."""

    name: str
    shape: tuple[int, ...]
    init: str
    fp8: bool
    dtype: torch.dtype = torch.bfloat16

    @property
    def per_expert(self) -> bool:
        return "{e}" in self.name

    @property
    def params(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        if self.fp8:
            return self.params + 4 * math.prod(FORMAT.scale_shape(self.shape))
        return self.params * self.dtype.itemsize


def planned(name: str, shape: tuple[int, ...], init: str = LINEAR, dtype: torch.dtype = torch.bfloat16) -> Planned:
    """A tensor stored in FP8 when the writer's rule (fp8_checkpoint.is_quantized) quantizes it."""
    one = name.format(e=0) if "{e}" in name else name
    meta = torch.empty(shape[1:] if "{e}" in name else shape, dtype=dtype, device="meta")
    return Planned(name, tuple(shape), init, is_quantized(one, meta, FORMAT), dtype)


def plan_tensors(config: ModelConfig, experts: str, mtp: bool = False) -> list[Planned]:
    """Every tensor of a qwen3_5_moe text model as the published files name and store them, and
    with mtp its MTP head (plan_mtp_tensors) last."""
    H, V = config.hidden_size, config.vocab_size
    plan = [planned(PREFIX + "embed_tokens.weight", (V, H), EMBED)]
    for i, mixer in enumerate(config.mixers):
        plan += layer_tensors(f"{PREFIX}layers.{i}.", mixer, config, experts)
    plan += [planned(PREFIX + "norm.weight", (H,), NORM), planned("lm_head.weight", (V, H))]
    return plan + (plan_mtp_tensors(config, experts) if mtp else [])


def plan_mtp_tensors(config: ModelConfig, experts: str) -> list[Planned]:
    """The published MTP head (verifier/model/mtp.py): the pre-fc norms, fc [H, 2H], one decoder
    layer of full attention with the sparse MLP stored as the main layers store theirs, the final norm."""
    H = config.hidden_size
    return [planned(MTP + "pre_fc_norm_embedding.weight", (H,), NORM), planned(MTP + "pre_fc_norm_hidden.weight", (H,), NORM),
            planned(MTP + "fc.weight", (H, 2 * H)), *layer_tensors(MTP + "layers.0.", ATTENTION, config, experts),
            planned(MTP + "norm.weight", (H,), NORM)]


def layer_tensors(p: str, mixer: str, config: ModelConfig, experts: str) -> list[Planned]:
    """One decoder layer's tensors under prefix p: its norms, its mixer (GDN or gated attention), its sparse MLP."""
    H, g, a, m = config.hidden_size, config.gdn, config.attention, config.moe
    E, I = m.n_experts, m.expert_intermediate_size
    plan = [planned(p + "input_layernorm.weight", (H,), NORM), planned(p + "post_attention_layernorm.weight", (H,), NORM)]
    if mixer == GDN:
        la = p + "linear_attn."
        plan += [planned(la + "in_proj_qkv.weight", (g.conv_dim, H)), planned(la + "in_proj_z.weight", (g.value_dim, H)),
                 planned(la + "in_proj_b.weight", (g.n_v_heads, H)), planned(la + "in_proj_a.weight", (g.n_v_heads, H)),
                 planned(la + "conv1d.weight", (g.conv_dim, 1, g.conv_width)), planned(la + "dt_bias", (g.n_v_heads,), DT_BIAS),
                 planned(la + "A_log", (g.n_v_heads,), A_LOG, torch.float32), planned(la + "norm.weight", (g.d_v,), GATED_NORM),
                 planned(la + "out_proj.weight", (H, g.value_dim))]
    else:
        assert mixer == ATTENTION, mixer
        sa, hd = p + "self_attn.", a.head_dim
        plan += [planned(sa + "q_proj.weight", (2 * a.n_heads * hd, H)), planned(sa + "k_proj.weight", (a.n_kv_heads * hd, H)),
                 planned(sa + "v_proj.weight", (a.n_kv_heads * hd, H)), planned(sa + "o_proj.weight", (H, a.n_heads * hd)),
                 planned(sa + "q_norm.weight", (hd,), NORM), planned(sa + "k_norm.weight", (hd,), NORM)]
    mlp, S = p + "mlp.", m.shared_intermediate_size
    plan += [planned(mlp + "gate.weight", (E, H)), planned(mlp + "shared_expert_gate.weight", (1, H)),
             planned(mlp + "shared_expert.gate_proj.weight", (S, H)), planned(mlp + "shared_expert.up_proj.weight", (S, H)),
             planned(mlp + "shared_expert.down_proj.weight", (H, S))]
    if experts == "fused":
        return plan + [planned(mlp + "experts.gate_up_proj", (E, 2 * I, H)), planned(mlp + "experts.down_proj", (E, H, I))]
    return plan + [planned(mlp + "experts.{e}." + n + ".weight", shape) for n, shape in
                   (("gate_proj", (E, I, H)), ("up_proj", (E, I, H)), ("down_proj", (E, H, I)))]


def draw(t: Planned, seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The tensor(s) one plan entry stores, on the host: {stored name: tensor}."""
    digest = hashlib.sha256(f"{seed}:{t.name}".encode()).digest()
    gen = torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little"))
    if t.fp8:
        std = 1.0 / math.sqrt(t.shape[-1])
        values = torch.randn(t.shape, generator=gen, device=device).mul_(FP8_SPREAD).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        factor = torch.empty(FORMAT.scale_shape(t.shape), device=device).uniform_(-1.0, 1.0, generator=gen).exp2_()
        stored = {t.name: values, t.name + "_scale_inv": factor.mul_(std / FP8_SPREAD)}  # fp32 [..., ceil(N/128), ceil(K/128)]
    else:
        stored = {t.name: _draw_dense(t, gen, device).to(t.dtype)}
    if not t.per_expert:
        return {name: value.cpu() for name, value in stored.items()}
    # one copy to the host per expert: separate allocations (a view would share its stack's storage)
    return {name.format(e=e): value[e].to("cpu", copy=True) for name, value in stored.items() for e in range(t.shape[0])}


def _draw_dense(t: Planned, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """fp32 values of a tensor stored in its dtype, by the init rules of random_checkpoint.py."""
    if t.init == A_LOG:
        return torch.empty(t.shape, device=device).uniform_(1.0, 16.0, generator=gen).log_()
    if t.init == DT_BIAS:
        return torch.empty(t.shape, device=device).uniform_(0.5, 1.5, generator=gen)
    noise = torch.randn(t.shape, generator=gen, device=device)
    if t.init in (NORM, GATED_NORM):  # Qwen's norms are zero-centred (y = norm(x) * (1 + w)), the gated one is not
        return noise.mul_(0.1).add_(1.0 if t.init == GATED_NORM else 0.0)
    return noise if t.init == EMBED else noise.mul_(1.0 / math.sqrt(t.shape[-1]))


def shard_plan(plan: list[Planned], shard_bytes: int) -> list[list[Planned]]:
    """Consecutive entries in shards of about shard_bytes (an entry is never split)."""
    shards, size = [[]], 0
    for t in plan:
        if shards[-1] and size + t.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def write_checkpoint(out: Path, config: dict, experts: str, seed: int, device: torch.device, shard_bytes: int,
                     mtp: bool = False) -> list[Planned]:
    """Write config.json, the shards and model.safetensors.index.json into out; -> the plan written.
    mtp: with the MTP head (its tensors last: every other tensor is drawn and sharded as without)."""
    out.mkdir(parents=True, exist_ok=True)
    plan = plan_tensors(config_from_dict(config), experts, mtp)
    shards = shard_plan(plan, shard_bytes)
    total = sum(t.nbytes for t in plan)
    weight_map: dict[str, str] = {}
    start, drawn, saving = time.perf_counter(), 0, None

    def save(tensors: dict[str, torch.Tensor], file: str, upto: int) -> None:
        save_file(tensors, str(out / file), {"format": "pt"})
        log(f"{file} written: {upto / 1e9:.1f} of {total / 1e9:.1f} GB, {time.perf_counter() - start:.0f} s")

    with ThreadPoolExecutor(max_workers=1) as saver:
        for i, shard in enumerate(shards):
            tensors = {name: value for t in shard for name, value in draw(t, seed, device).items()}
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            weight_map.update(dict.fromkeys(tensors, file))
            drawn += sum(t.nbytes for t in shard)
            if saving is not None:
                saving.result()  # one shard is saved while the next is drawn: host memory holds two
            saving = saver.submit(save, tensors, file, drawn)
        saving.result()
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return plan


def params(plan: list[Planned], config: ModelConfig) -> tuple[int, int]:
    """(total, active per token) of the text model (the MTP head apart): the unchosen experts' parameters are not active."""
    plan = [t for t in plan if not t.name.startswith(MTP)]
    total = sum(t.params for t in plan)
    expert = sum(t.params for t in plan if ".experts." in t.name)
    return total, total - expert + expert * config.moe.top_k // config.moe.n_experts


def logits_check(model) -> dict:
    """A prefill's last logits: finite, and not all equal (the random weights keep 40 layers sane)."""
    gen = torch.Generator().manual_seed(2)
    pool = model.new_pool(1, PROMPT_LEN)
    logits = model.prefill(pool, 0, torch.randint(3, 1000, (PROMPT_LEN,), generator=gen).tolist()).float()
    finite = bool(torch.isfinite(logits).all())
    return {"logits_finite": finite, "logits_std": float(logits.std()) if finite else None,
            "logits_sane": finite and bool(logits.max() > logits.min())}


def max_seq_len(steps: int) -> int:
    """The engines' max_seq_len: the prompt, every figure's steps (a rejected step advances one position), a verify."""
    return max(BUCKETS[-1], PROMPT_LEN + 2 * (steps + WARMUP) + K + 1)


def time_steps(model, steps: int) -> dict:
    """Engine steps (verify + acceptance + rollback, drafts all rejected), medians in ms, each
    shape replaying its own CUDA graph bucket: batch 1 and 64, K = 0 and 8."""
    engine = Engine(model, BATCH, max_seq_len(steps), max_k=K, graph_rows=BUCKETS)
    start = time.perf_counter()
    engine.warm_up()
    out = {"graph_buckets": list(BUCKETS), "warm_up_s": time.perf_counter() - start}
    for n in (1, BATCH):
        seqs = open_sequences(engine, n)
        for _, k, key in (f for f in FIGURES if f[0] == n):
            out[key] = median_ms(lambda: rejected_step(engine, seqs, k), steps, WARMUP)
        for s in seqs:
            engine.close(s)
    out["graph_captures"] = engine.graph_captures
    return out


def own_floors(model, steps: int, bandwidth: float | None) -> dict:
    """Each figure's own floor (bench/step_floor.py) from the routing of its steps: an eager engine
    (the routers run in Python, hooked) opens the same prompts and runs the steps time_steps runs,
    in its order; the floor is the mean over the timed steps (not the warm-ups). With a bandwidth
    (CUDA): floor_ms, and the kernel table of each figure's last step (bench.gpu.kernel_table)."""
    engine = Engine(model, BATCH, max_seq_len(steps), max_k=K, cuda_graphs=False)
    sizes = model_sizes(model, engine.pool)
    floors, kernels = {}, {}
    for n in (1, BATCH):
        seqs = open_sequences(engine, n)
        for _, k, key in (f for f in FIGURES if f[0] == n):
            timed = []
            for i in range(WARMUP + steps):
                before = [SequenceStep(s.position, k + 1, engine.pool.carried[s.slot]) for s in seqs]
                with recorded_routing(model) as routed:
                    if bandwidth is not None and i == WARMUP + steps - 1:
                        kernels[key] = kernel_table(lambda: rejected_step(engine, seqs, k))
                    else:
                        rejected_step(engine, seqs, k)
                kept = [SequenceStep(b.start, b.rows, b.carried, s.position - b.start) for s, b in zip(seqs, before)]
                if i >= WARMUP:
                    timed.append(step_floor(sizes, kept, distinct_experts(routed), bandwidth))
            floors[key] = mean_floor(timed, sizes.n_experts)
        for s in seqs:
            engine.close(s)
    return {"step_floors": floors, "kernel_breakdowns": kernels if bandwidth is not None else None}


def serve(path: Path, device: torch.device, dtype: torch.dtype, steps: int, mtp: bool = False) -> dict:
    """Load, gate, and (CUDA) time the checkpoint at path; with mtp, then its MTP head's drafts."""
    cuda = device.type == "cuda"
    if cuda:  # measured on the empty device, so that the peak memory below is the model's and the engine's
        bandwidth = copy_bandwidth()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    model = load_model(path, device, dtype)
    out = {"load_s": time.perf_counter() - start, "decode_weight_bytes": decode_bytes(model)}
    out["weights_gib"] = torch.cuda.memory_allocated() / 2**30 if cuda else None
    log(f"load: {out['load_s']:.1f} s; a decode step reads {out['decode_weight_bytes'] / 1e9:.2f} GB of weights")
    start = time.perf_counter()
    out.update(logits_check(model))
    equal, total = bitexact_rows(model, k=K)
    out["bitexact_rows"] = f"{equal}/{total}"
    full = full_batch_vs_alone(model, FULL_BATCH, lambda message: log(f"gate: {message}"))
    out["full_batch_rows"] = f"{full.rows.equal}/{full.rows.checked}"
    out["full_batch_states"] = f"{full.states.equal}/{full.states.checked}"
    out["full_batch_step_rows"] = full.batch_rows
    out["full_batch_first_difference"] = None if full.first_difference is None else full.first_difference.describe()
    out["gate"] = "green" if out["logits_sane"] and equal == total and full.passed else "red"
    out["gate_s"] = time.perf_counter() - start
    log(f"gate {out['gate']}: logits finite {out['logits_finite']} (std {out['logits_std']}), "
        f"{out['bitexact_rows']} verify rows equal serial decode, full batch of {BATCH}: {out['full_batch_rows']} rows and "
        f"{out['full_batch_states']} layer states equal alone, {out['gate_s']:.1f} s")
    out.update(dict.fromkeys(TIMED, None))
    out["mtp_draft"] = None
    if out["gate"] != "green":
        return out  # no timing and no floors when the gate is red
    if cuda:  # the CPU reference is not timed
        out["hbm_copy_bandwidth_bytes_per_s"] = bandwidth
        out["hbm_floor_ms"] = out["decode_weight_bytes"] / bandwidth * 1e3
        start = time.perf_counter()
        out.update(time_steps(model, steps))
        out["time_s"] = time.perf_counter() - start
        out["gpu_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30  # the timed engine's peak, before the floors' engine
        log(f"time: {out['time_s']:.0f} s; floor {out['hbm_floor_ms']:.2f} ms, decode b1 {out['decode_ms_b1']:.2f} ms, "
            f"K={K} b1 {out[f'verify_k{K}_ms_b1']:.2f}, decode b64 {out['decode_ms_b64']:.2f}, K={K} b64 {out[f'verify_k{K}_ms_b64']:.2f}")
        gc.collect()  # the timed engine's pool goes before the floors' engine makes one as large
        torch.cuda.empty_cache()
    start = time.perf_counter()
    out.update(own_floors(model, steps, bandwidth if cuda else None))
    out["floors_s"] = time.perf_counter() - start
    for _, _, key in FIGURES:
        floor = out["step_floors"][key]
        floor["ratio"] = out[key] / floor["floor_ms"] if cuda else None  # the figure over its own floor
        experts = floor["distinct_experts"]
        log(f"{key}: {floor['total_bytes'] / 1e9:.3f} GB a step, distinct experts a layer {experts['mean']:.1f} of {experts['of']}"
            + (f"; own floor {floor['floor_ms']:.2f} ms, measured {out[key]:.2f} ms ({floor['ratio']:.1f}x)" if cuda else ""))
    if cuda:
        out["kernel_figures"] = kernel_figures(out, fp8_dense_params(model))
    if mtp:  # last: loading the head changes none of the figures above
        try:
            out["mtp_draft"] = mtp_draft(path, model, steps, bandwidth if cuda else None, out["decode_ms_b1"],
                                         warmup=WARMUP, log=log)  # warmed up and logged as the figures above
        except Exception as exc:  # the figures above stand; the results file and the exit status say what failed
            out["mtp_draft"] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"MTP draft failed: {out['mtp_draft']['error']}")
        if cuda:
            out["per_token"] = per_token(out)
            if out["per_token"]:
                log("per output token at one request with the MTP head (assumed acceptance "
                    + ", ".join(f"K={k}: {a}" for k, a in PUBLISHED_MTP_ACCEPTANCE.items()) + "): "
                    + ", ".join(f"K={k} {out['per_token'][f'k{k}_ms']:.2f} ms" for k in PUBLISHED_MTP_ACCEPTANCE
                                if out["per_token"][f"k{k}_ms"] is not None))
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder of the results JSON")
    parser.add_argument("--config", default="qwen3.6-35b-a3b", choices=sorted(published_configs()), help="published config.json")
    parser.add_argument("--workdir", type=Path, default=None, help="the checkpoint goes in a new folder here (None: the system's temporary folder)")
    parser.add_argument("--steps", type=int, default=20, help="timed engine steps per figure (medians)")
    parser.add_argument("--scale", choices=("full", "tiny"), default="full", help="published sizes, or shrunk for a CPU test")
    parser.add_argument("--experts", choices=("per-expert", "fused"), default="per-expert", help="expert tensors' layout")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="draws the weights and serves them")
    parser.add_argument("--shard-gb", type=float, default=4.0, help="checkpoint shard size (GB)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--mtp", action=argparse.BooleanOptionalAction, default=True,
                        help="write the MTP head (as published) and time its drafts after every other figure")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint after the run")
    parser.add_argument("--candidates", type=Path, default=None,
                        help="a bench.fp8_configs results file: run its winning kernel configs instead of the pinned ones "
                             "(recorded as kernel_candidates), to judge them in the engine")
    parser.add_argument("--expert-walk", choices=("scale-after", "dequantize"), default=None,
                        help="run the grouped FP8 experts with this K walk (bench/kernel_candidates.py's WALKS) "
                             "instead of the code's default; recorded as expert_walk")
    parser.add_argument("--expert-k-parts", type=int, choices=(1, 2), default=None,
                        help="run stage 1 of the experts' scale-after walk with H summed in this many parts "
                             "(kernels/moe_grouped.py, SCALE_AFTER_PARTS) instead of the code's default; recorded as "
                             "expert_k_parts")
    parser.add_argument("--dense-walk", choices=("scale-after", "dequantize"), default=None,
                        help="run the dense block-FP8 GEMMs with this K walk (bench/kernel_candidates.py's WALKS; "
                             "kernels/linear_fp8.py) instead of the code's default; recorded as dense_walk")
    parser.add_argument("--name", default="", type=name_arg,
                        help="appended to the file name after the config: what differs (e.g. the device, so that each "
                             "device keeps its newest figures)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Run the bench; -> the results (also written to --out). bf16 on CUDA, fp32 on the CPU reference."""
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = checkpoint_config(args.config, args.scale)
    parsed = config_from_dict(config)
    if parsed.model_type != "qwen3_5_moe":
        raise SystemExit(f"--config {args.config}: the bench writes qwen3_5_moe checkpoints, not {parsed.model_type}")
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    today = datetime.date.today().isoformat()
    result = {"device": device_name(device.type), "date": today, "torch": torch.__version__, "triton": triton_version,
              "config": args.config, "scale": args.scale, "experts": args.experts, "dtype": str(dtype).removeprefix("torch."),
              "quantization_config": config["quantization_config"], "steps": args.steps, "mtp": args.mtp}
    if args.candidates is not None:
        from bench.kernel_candidates import apply_winners

        result["kernel_candidates"] = apply_winners(args.candidates)
        log(f"kernel candidates from {args.candidates}: {result['kernel_candidates']}")
    from bench.kernel_candidates import apply_k_parts, apply_walk, current_walk

    for kind, walk in (("expert", args.expert_walk), ("dense", args.dense_walk)):
        if walk is not None:
            apply_walk(kind, walk)
        result[f"{kind}_walk"] = current_walk(kind)
    result["expert_k_parts"] = apply_k_parts(args.expert_k_parts)
    import hybrid_kernels.moe_grouped as mg

    # the launches that follow the row count, as this run has them (pinned, or a candidate's)
    result["expert_launches"] = {"up_to_rows": mg.FEW_ROWS, "few_rows": dict(mg.FEW_ROWS_LAUNCH),
                                 "from_rows": mg.MANY_ROWS, "many_rows": dict(mg.MANY_ROWS_LAUNCH)}
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="fp8_real_size_", dir=args.workdir))
    path = workdir / f"{args.config}-fp8"
    try:
        start = time.perf_counter()
        plan = write_checkpoint(path, config, args.experts, args.seed, device, int(args.shard_gb * 1e9), args.mtp)
        result["write_s"] = time.perf_counter() - start
        result["params_total"], result["params_active"] = params(plan, parsed)
        result["mtp_gb"] = sum(t.nbytes for t in plan if t.name.startswith(MTP)) / 1e9  # within checkpoint_gb
        result["checkpoint_gb"] = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e9
        log(f"write: {result['write_s']:.1f} s, {result['checkpoint_gb']:.1f} GB, {result['params_total'] / 1e9:.2f} B parameters "
            f"({result['params_active'] / 1e9:.2f} B active)")
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        result.update(serve(path, device, dtype, args.steps, args.mtp))
    except BaseException as exc:  # the results file says how far the run got
        result["error"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        if args.keep:
            log(f"kept the checkpoint in {path}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
        args.out.mkdir(parents=True, exist_ok=True)
        out_file = results_path(args.out, "fp8_real_size", today,
                                args.config + ("_fused" if args.experts == "fused" else "") + (f"_{args.name}" if args.name else ""))
        out_file.write_text(json.dumps(result, indent=2) + "\n")
        log(f"wrote {out_file}")
    return result


def per_token(result: dict) -> dict | None:
    """ms per output token at one request with the checkpoint's MTP head drafting K tokens: (the
    graphed MTP draft of K + the batch-1 verify of K + 1 rows) / the mean acceptance length, for the
    K of PUBLISHED_MTP_ACCEPTANCE (an assumption the results file states beside the figure)."""
    drafts = (result.get("mtp_draft") or {}).get("drafts")
    if not drafts:
        return None
    out = {"assumed_mean_acceptance_length": {str(k): a for k, a in PUBLISHED_MTP_ACCEPTANCE.items()},
           "assumption": "mean acceptance lengths published for these MTP heads; the checkpoint's weights are random"}
    for k, accepted in PUBLISHED_MTP_ACCEPTANCE.items():
        draft, verify = drafts.get(str(k), {}).get("ms"), result.get(f"verify_k{k}_ms_b1")
        out[f"k{k}_ms"] = None if draft is None or verify is None else (draft + verify) / accepted
    return out


def fp8_dense_params(model) -> int:
    """Parameters of the block-FP8 weights outside the experts (kernels/linear_fp8.py multiplies them)."""
    total = 0
    for block in model.blocks:
        for owner in (block.mixer, block.mlp, getattr(block.mlp, "shared", None)):
            for value in vars(owner).values() if owner is not None else ():
                groups = value.groups if isinstance(value, OutFeatureGroups) else (value,)
                total += sum(g.data.numel() for g in groups if isinstance(g, BlockFP8Weight) and g.data.dim() == 2)
    return total


def kernel_figures(result: dict, fp8_params: int) -> dict:
    """The step's kernels against their own bytes or FLOPs (each from its figure's kernel table):
    the FP8 GEMM's weight bytes per second at one row and its TFLOP/s at BATCH x (K + 1) rows
    (None where those rows take the dequantized path: then the dequantization's ms), the
    routed experts' distinct expert bytes per second at batch 1 and BATCH, and the launches of
    torch's sort and top-k (the routing should have none)."""
    tables = result.get("kernel_breakdowns") or {}

    def device_ms(key: str, names: tuple[str, ...]) -> float | None:
        table = tables.get(key)
        if table is None:
            return None
        rows = [r for r in table["top"] if r["kernel"] in names]
        return sum(r["device_ms"] for r in rows) if rows else None

    out = {"fp8_dense_params": fp8_params}
    one_row, many = "decode_ms_b1", f"verify_k{K}_ms_b{BATCH}"
    ms = device_ms(one_row, FP8_GEMM_KERNELS)
    out["fp8_gemm_one_row_tb_s"] = None if ms is None else fp8_params / (ms / 1e3) / 1e12
    dequantized = device_ms(many, (DEQUANTIZE_KERNEL,))
    ms = None if dequantized is not None else device_ms(many, FP8_GEMM_KERNELS)
    out[f"fp8_gemm_{BATCH * (K + 1)}_rows_tflop_s"] = None if ms is None else 2 * BATCH * (K + 1) * fp8_params / (ms / 1e3) / 1e12
    out[f"fp8_dequantize_{BATCH * (K + 1)}_rows_ms"] = dequantized
    for key in ("decode_ms_b1", f"decode_ms_b{BATCH}"):
        ms = device_ms(key, EXPERT_KERNELS)
        routed = result["step_floors"][key]["bytes"]["routed_experts"] if result.get("step_floors") else None
        out[f"routed_experts_{key.removeprefix('decode_ms_')}_tb_s"] = None if ms is None or routed is None else routed / (ms / 1e3) / 1e12
    out["sort_topk_launches"] = {key: table.get("sort_topk_launches") for key, table in tables.items()}
    out["launches"] = {key: table["launches"] for key, table in tables.items()}
    return out


def passed(result: dict) -> bool:
    """A green gate, and no MTP draft that failed."""
    return result["gate"] == "green" and "error" not in (result.get("mtp_draft") or {})


if __name__ == "__main__":
    sys.exit(0 if passed(main()) else 1)
