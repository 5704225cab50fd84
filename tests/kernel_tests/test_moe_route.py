"""kernels/moe_route.py: the routing launch against its torch reference, its grouping, row invariance.

The kernel and route_ref compute the same formulas; exp's last bits differ between the GPU, numpy
(the interpreter) and torch, so weights agree within 1e-6 relative (a few fp32 ulps, then the
bf16 rounding of the softmax router's weights: one bf16 ulp, 2^-8 relative, where a value sits on a
rounding boundary) and the chosen ids are equal where no two choices are within that tolerance
(random logits: none are)."""

import pytest
import torch

from hybrid_kernels import moe, moe_route
from hybrid_kernels.linear import linear
from hybrid_kernels.moe_route import GATED_SHARED, NO_SHARED, SIGMOID, SOFTMAX, UNGATED_SHARED, route, route_ref

from .conftest import ROW_COUNTS

E, T = 12, 3

CASES = {
    "softmax-renorm": dict(router=SOFTMAX, renormalize=True, shared=NO_SHARED),
    "softmax-gated-shared": dict(router=SOFTMAX, renormalize=True, shared=GATED_SHARED),
    "softmax-plain": dict(router=SOFTMAX, renormalize=False, shared=NO_SHARED),
    "sigmoid-bias-shared": dict(router=SIGMOID, renormalize=True, shared=UNGATED_SHARED, bias=True, scaling=2.5),
}


def make(case: dict, rows: int, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    columns = E + (case["shared"] == GATED_SHARED)
    dtype = torch.float32 if case["router"] == SIGMOID else torch.bfloat16
    logits = (torch.randn(rows, columns, generator=g) * 2).to(dtype).to(device)
    kwargs = {k: v for k, v in case.items() if k != "bias"}
    if case.get("bias"):
        kwargs["bias"] = (torch.randn(E, generator=g) * 0.1).to(device)
    kwargs["weight_dtype"] = torch.bfloat16 if case["router"] == SOFTMAX else torch.float32
    return logits, kwargs


def counts_for(case: dict, device: str) -> torch.Tensor:
    return torch.zeros(E + (case["shared"] != NO_SHARED), dtype=torch.int32, device=device)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_reference_and_groups_every_pair(device, case):
    logits, kwargs = make(case, 7, device)
    routing = route(logits, E, T, counts_for(case, device), **kwargs)
    ids, weights = route_ref(logits.cpu(), E, T, **{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()})
    assert torch.equal(routing.ids.cpu(), ids), f"ids {routing.ids.cpu().tolist()} != {ids.tolist()}"
    assert torch.allclose(routing.weights.cpu(), weights, rtol=2.0**-8, atol=0), (routing.weights.cpu() - weights).abs().max()
    slots = routing.ids.shape[1]
    assert slots == T + (case["shared"] != NO_SHARED)
    if case["shared"] != NO_SHARED:
        assert (routing.ids[:, T] == E).all()
    flat = routing.ids.cpu().reshape(-1)
    counts = routing.counts.cpu()
    assert torch.equal(counts, torch.bincount(flat, minlength=len(counts)).int())
    for e in range(len(counts)):
        listed = sorted(routing.lists[e, : counts[e]].cpu().tolist())
        assert listed == (flat == e).nonzero().reshape(-1).tolist(), f"expert {e}: list {listed}"


def test_split_sums_finish_as_the_reduce(device):
    """The router GEMM's unfinished split-K sums give the ids and weights of its finished logits."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 2048, generator=g).bfloat16().to(device)
    w = (torch.randn(E + 1, 2048, generator=g) / 45).bfloat16().to(device)
    sums = linear(x, w, defer_split=True)
    finished = linear(x, w)
    if isinstance(sums, torch.Tensor):
        pytest.skip("this backend does not split the router's K (fp32 never splits)")
    case = CASES["softmax-gated-shared"]
    kwargs = dict(router=SOFTMAX, renormalize=True, shared=GATED_SHARED, weight_dtype=torch.bfloat16)
    a = route(sums, E, T, counts_for(case, device), **kwargs)
    b = route(finished, E, T, counts_for(case, device), **kwargs)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.weights, b.weights)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_row_invariance(device, case):
    logits, kwargs = make(case, max(ROW_COUNTS), device, seed=1)
    full = route(logits, E, T, counts_for(case, device), **kwargs)
    for r in ROW_COUNTS:
        part = route(logits[:r], E, T, counts_for(case, device), **kwargs)
        assert torch.equal(part.ids, full.ids[:r]) and torch.equal(part.weights, full.weights[:r]), f"rows 0..{r} differ"


def test_ties_choose_the_lowest_id(device):
    logits = torch.zeros(2, E, dtype=torch.bfloat16, device=device)
    routing = route(logits, E, T, torch.zeros(E, dtype=torch.int32, device=device), router=SOFTMAX, renormalize=True)
    assert routing.ids.cpu().tolist() == [[0, 1, 2], [0, 1, 2]]
    assert torch.equal(routing.weights.cpu(), torch.full((2, 3), 1 / 3).bfloat16().float())


def test_order_of_infinities_zeros_and_nan(device):
    """The choice order, whole: larger first, equal values (the two zeros too) to the lowest id, -inf
    after every number and NaN after -inf (the sigmoid router's choice is score + bias; every score
    here is sigmoid(0) = 0.5)."""
    inf, nan = float("inf"), float("nan")
    bias = torch.tensor([0.25, 0.0, 0.25, -inf, nan, inf, -0.5, 0.0, nan, -inf, 0.25, -0.5], device=device)
    logits = torch.zeros(3, E, dtype=torch.float32, device=device)
    routing = route(logits, E, E, torch.zeros(E, dtype=torch.int32, device=device), router=SIGMOID, renormalize=False,
                    bias=bias, weight_dtype=torch.float32)
    want = [5, 0, 2, 10, 1, 7, 6, 11, 3, 9, 4, 8]
    assert routing.ids.cpu().tolist() == [want] * 3
    assert torch.equal(routing.weights.cpu(), torch.full((3, E), 0.5))


def test_experts_reset_the_counts(device):
    """The grouped experts leave counts all zero: the next routing of the layer starts from there."""
    case = CASES["softmax-gated-shared"]
    logits, kwargs = make(case, 4, device, seed=2)
    counts = counts_for(case, device)
    routing = route(logits, E, T, counts, **kwargs)
    assert int(counts.sum()) == 4 * (T + 1)
    h, i = 32, 16
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, h, generator=g).to(device)
    w_gate, w_up = (torch.randn(E + 1, i, h, generator=g).to(device) / 8 for _ in range(2))
    w_down = torch.randn(E + 1, h, i, generator=g).to(device) / 8
    out = moe.moe_experts_routed(x, routing, w_gate, w_up, w_down)
    assert int(counts.abs().sum()) == 0
    want = moe.moe_experts_ref(x.cpu(), routing.ids.cpu(), routing.weights.cpu(), w_gate.cpu(), w_up.cpu(), w_down.cpu())
    assert torch.allclose(out.cpu(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bad, message", [
    (dict(columns=E + 1), "logits have 13 columns; 12 experts need 12"),
    (dict(top_k=0), "top_k 0 must be in"),
    (dict(counts=E + 1), r"counts"),
    (dict(router="relu"), "router must be"),
])
def test_errors_name_the_argument(device, bad, message):
    logits = torch.zeros(2, bad.get("columns", E), dtype=torch.bfloat16, device=device)
    counts = torch.zeros(bad.get("counts", E), dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=message):
        route(logits, E, bad.get("top_k", T), counts, router=bad.get("router", SOFTMAX))


def test_module_constants():
    assert {moe_route.NO_SHARED, moe_route.GATED_SHARED, moe_route.UNGATED_SHARED} == {0, 1, 2}
