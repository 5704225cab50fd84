"""One engine step's own memory floor (DESIGN.md section 4: each step is measured against the bytes it
must move, never against a decode's weights alone): its bytes over the measured copy bandwidth.
How it measures, what it checks and writes: bench/README.md, Methods, `bench.step_floor`.
"""

from __future__ import annotations

import statistics
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from bench.gpu import decode_bytes, layer_expert_bytes, weight_bytes
from verifier.model.state import AttentionState, RecurrentState

CATEGORIES = ("dense_weights", "embedding_rows", "routed_experts", "recurrent_state", "woa_stash", "kv_read", "kv_written")
DRAFT_CATEGORIES = ("mtp_layer", "fc_and_norms", "lm_head", "embedding_rows", "routed_experts", "kv_read", "kv_written")


@dataclass(frozen=True)
class ModelSizes:
    """The per-unit bytes a step's floor multiplies, of one model and its engine's pool."""

    dense: int  # weights every step reads once (module docstring: dense_weights)
    embed_row: int  # one embedding row
    expert: dict[int, int]  # MoE layer index -> one routed expert's bytes
    n_experts: int
    recurrent_state: int  # per sequence, over the recurrent layers: one state and one conv window
    stash_row: int  # per row, over the recurrent layers: one stash row (key, value, decay, beta)
    kv_position: int  # per position, over the attention layers: its keys and values


@dataclass(frozen=True)
class SequenceStep:
    """One sequence of a step: its committed position, its rows (pending + drafts), the rows its
    slot carried into the step, and the rows the step kept (accepted + 1)."""

    start: int
    rows: int
    carried: int = 0
    kept: int = 1


def model_sizes(model, pool) -> ModelSizes:
    """The sizes of `model` as loaded and of `pool`, a write-on-accept pool that carries rows."""
    recurrent = [layer for layer in pool.layers if isinstance(layer, RecurrentState)]
    if recurrent and not pool.carry_rows:
        raise ValueError("model_sizes: the floor is a write-on-accept engine's that carries rows (max_k > 0)")
    moe = {i: block.mlp for i, block in enumerate(model.blocks) if hasattr(block.mlp, "w_router")}
    expert = {i: layer_expert_bytes(mlp) for i, mlp in moe.items()}
    top_k = model.config.moe.top_k if moe else 0

    def one_slot(t: torch.Tensor) -> int:  # dim 0 is the slot
        return t[0].numel() * t.element_size()

    def one_row(t: torch.Tensor) -> int:  # dims 0, 1 are the slot and the carried row
        return t[0, 0].numel() * t.element_size()

    return ModelSizes(
        dense=decode_bytes(model) - top_k * sum(expert.values()),
        embed_row=weight_bytes(model.embed[0]),
        expert=expert,
        n_experts=model.config.moe.n_experts if moe else 0,
        recurrent_state=sum(one_slot(layer.recurrent) + one_slot(layer.conv) for layer in recurrent),
        stash_row=sum(one_row(t) for layer in recurrent for t in layer.carry.tensors),
        kv_position=sum(one_row(layer.keys) + one_row(layer.values) for layer in pool.layers if isinstance(layer, AttentionState)),
    )


def step_bytes(sizes: ModelSizes, sequences: list[SequenceStep], distinct: dict[int, int]) -> dict[str, int]:
    """The bytes of one step (module docstring), by category. distinct: per MoE layer, the
    distinct experts the step's rows routed to (distinct_experts)."""
    if distinct.keys() != sizes.expert.keys():
        raise ValueError(f"step_bytes: routing of layers {sorted(distinct)}, MoE layers {sorted(sizes.expert)}")
    stash_rows = sum((s.rows + 2 * s.kept if s.rows > 1 else 0) + s.carried for s in sequences)
    return {
        "dense_weights": sizes.dense,
        "embedding_rows": sizes.embed_row * sum(s.rows for s in sequences),
        "routed_experts": sum(sizes.expert[layer] * n for layer, n in distinct.items()),
        "recurrent_state": 2 * sizes.recurrent_state * len(sequences),
        "woa_stash": sizes.stash_row * stash_rows,
        "kv_read": sizes.kv_position * sum(s.start for s in sequences),
        "kv_written": sizes.kv_position * sum(s.rows for s in sequences),
    }


@contextmanager
def recorded_routing(model):
    """Within: every MoE layer's router (MoE.route) records the expert ids it returns ->
    {MoE layer index: [ids [rows, top_k], ...]} (the CPU reference routes row by row: one entry a
    row). Only Python runs are seen: a CUDA graph replay calls no router, so record an eager step.
    The ids are kept as they are (no copy, no sync: a profiled step runs no extra kernel).
    model: anything with `blocks` (a HybridModel; an MTPHead's layers as SimpleNamespace(blocks=...))."""
    routed: dict[int, list[torch.Tensor]] = {}
    hooked = []
    for i, block in enumerate(model.blocks):
        mlp = block.mlp
        if not hasattr(mlp, "w_router"):
            continue
        routed[i] = []

        def route(x, _route=mlp.route, _ids=routed[i], _top_k=mlp.cfg.top_k):
            routing = _route(x)  # (ids, weights) or a Routing: the ids first, the routed slots before a folded shared expert's
            _ids.append(routing[0][:, :_top_k])
            return routing

        mlp.route = route  # an instance attribute over the class's method, removed below
        hooked.append(mlp)
    try:
        yield routed
    finally:
        for mlp in hooked:
            del mlp.route


def distinct_experts(routed: dict[int, list[torch.Tensor]]) -> dict[int, int]:
    """{MoE layer: the number of distinct expert ids its recorded rows routed to}."""
    return {layer: int(torch.cat([ids.reshape(-1) for ids in batches]).unique().numel()) for layer, batches in routed.items()}


def step_floor(sizes: ModelSizes, sequences: list[SequenceStep], distinct: dict[int, int], bandwidth: float | None) -> dict:
    """One step's floor: bytes by category, their total, floor_ms (None without a bandwidth: the
    CPU reference measures none), the distinct experts per MoE layer, rows and sequences."""
    parts = step_bytes(sizes, sequences, distinct)
    total = sum(parts.values())
    return {"bytes": parts, "total_bytes": total, "floor_ms": None if bandwidth is None else total / bandwidth * 1e3,
            "distinct_experts": dict(distinct), "rows": sum(s.rows for s in sequences), "sequences": len(sequences)}


def mean_floor(floors: list[dict], n_experts: int) -> dict:
    """The floor of a figure timed over several steps (their routing differs): each category's
    mean bytes, the mean floor_ms with the steps' least and most, and the distinct experts per
    MoE layer over every layer and step (mean, min, max) of the n_experts a layer has, with each
    layer's mean over the steps (`per_layer`, keyed by layer index)."""
    counts = [n for f in floors for n in f["distinct_experts"].values()]
    per_layer = {str(layer): statistics.fmean(f["distinct_experts"][layer] for f in floors) for layer in floors[0]["distinct_experts"]}
    ms = [f["floor_ms"] for f in floors]
    timed = all(m is not None for m in ms)
    return {
        "steps": len(floors),
        "rows": floors[0]["rows"],
        "sequences": floors[0]["sequences"],
        "bytes": {c: statistics.fmean(f["bytes"][c] for f in floors) for c in CATEGORIES},
        "total_bytes": statistics.fmean(f["total_bytes"] for f in floors),
        "floor_ms": statistics.fmean(ms) if timed else None,
        "floor_ms_min": min(ms) if timed else None,
        "floor_ms_max": max(ms) if timed else None,
        "distinct_experts": {"mean": statistics.fmean(counts), "min": min(counts), "max": max(counts), "of": n_experts,
                             "per_layer": per_layer} if counts else None,
    }


@dataclass(frozen=True)
class DraftSizes:
    """The per-unit bytes an MTP draft's floor multiplies (module docstring), of one MTP layer."""

    mtp_layer: int
    fc_and_norms: int
    lm_head: int
    embed_row: int
    expert: int  # one routed expert's gate, up and down (0: a dense MTP layer)
    n_experts: int
    kv_position: int  # per position: the MTP layer's keys and values


@dataclass(frozen=True)
class DraftForward:
    """One forward of an MTP draft: its first position, its rows, the distinct experts they route to."""

    start: int
    rows: int
    distinct: int


def draft_sizes(head, pool) -> DraftSizes:
    """The sizes of an MTPHead as loaded (one MTP layer, as the published files hold) and of its pool."""
    if head.n_layers != 1:
        raise ValueError(f"draft_sizes: {head.n_layers} MTP layers; the floor is counted for one")
    mlp = head.layers[0].mlp
    moe = hasattr(mlp, "w_router")
    expert = layer_expert_bytes(mlp) if moe else 0
    top_k = head.config.moe.top_k if moe else 0
    lm_head, final_norm = weight_bytes(head.lm_head), weight_bytes(head.final_norm)
    # decode_bytes counts a model's blocks (top_k routed experts each), LM head and final norm:
    # here the MTP layer with the head's LM head and final norm
    counted = decode_bytes(SimpleNamespace(blocks=head.layers, config=head.config, lm_head=head.lm_head, final_norm=head.final_norm))
    (kv,) = pool.layers
    return DraftSizes(
        mtp_layer=counted - top_k * expert - lm_head - final_norm,
        fc_and_norms=sum(weight_bytes(w) for w in (head.w_fc, head.norm_embedding, head.norm_hidden)) + final_norm,
        lm_head=lm_head,
        embed_row=weight_bytes(head.embed[0]),
        expert=expert,
        n_experts=head.config.moe.n_experts if moe else 0,
        kv_position=kv.keys[0, 0].numel() * kv.keys.element_size() + kv.values[0, 0].numel() * kv.values.element_size(),
    )


def draft_bytes(sizes: DraftSizes, forwards: list[DraftForward]) -> dict[str, int]:
    """The bytes of one MTP draft of len(forwards) tokens (module docstring), by category."""
    n = len(forwards)
    return {
        "mtp_layer": n * sizes.mtp_layer,
        "fc_and_norms": n * sizes.fc_and_norms,
        "lm_head": n * sizes.lm_head,
        "embedding_rows": sizes.embed_row * sum(f.rows for f in forwards),
        "routed_experts": sizes.expert * sum(f.distinct for f in forwards),
        "kv_read": sizes.kv_position * sum(f.start for f in forwards),
        "kv_written": sizes.kv_position * sum(f.rows for f in forwards),
    }


def mean_draft_floor(drafts: list[list[DraftForward]], sizes: DraftSizes, bandwidth: float | None) -> dict:
    """The floor of an MTP draft timed over several steps (their routing differs): each category's
    mean bytes, their total, floor_ms (None without a bandwidth), and per forward its rows and the
    mean distinct experts its rows route to (of n_experts)."""
    parts = [draft_bytes(sizes, forwards) for forwards in drafts]
    mean = {c: statistics.fmean(p[c] for p in parts) for c in DRAFT_CATEGORIES}
    total = sum(mean.values())
    return {
        "steps": len(drafts),
        "bytes": mean,
        "total_bytes": total,
        "floor_ms": None if bandwidth is None else total / bandwidth * 1e3,
        "forward_rows": [f.rows for f in drafts[0]],
        "distinct_experts": {"per_forward": [statistics.fmean(d[i].distinct for d in drafts) for i in range(len(drafts[0]))],
                             "of": sizes.n_experts},
    }
