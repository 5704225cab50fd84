"""Choosing tokens from logits.
The design in full: DESIGN.md section 7, "Choosing tokens".
"""

from __future__ import annotations

import torch

from hybrid_kernels.runtime import pick
from hybrid_kernels.sampling import coupled_choice, coupled_choice_ref, cumsum_rows, cumsum_rows_ref

from .params import STREAM_CHOOSE, SamplingParams

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _generator(seed: int, position: int, stream: int) -> torch.Generator:
    key = _splitmix64(_splitmix64(_splitmix64(seed) ^ position) ^ stream)
    return torch.Generator().manual_seed(key & ((1 << 63) - 1))


def uniform(seed: int, position: int, stream: int) -> float:
    """One U[0, 1) draw keyed by (seed, position, stream)."""
    return float(torch.rand(1, generator=_generator(seed, position, stream), dtype=torch.float64))


def gumbel(seed: int, position: int, vocab: int, stream: int = STREAM_CHOOSE) -> torch.Tensor:
    """A Gumbel(0, 1) vector [vocab] fp32 keyed by (seed, position, stream); drawn on the CPU."""
    u = torch.rand(vocab, generator=_generator(seed, position, stream), dtype=torch.float32)
    return -torch.log(-torch.log(u))  # u = 0 gives -inf: never chosen


def masked_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [vocab] -> fp32 logits / T with -inf outside the top-k / top-p set (temperature > 0)."""
    scaled = logits.float().cpu() / params.temperature
    if params.top_k and params.top_k < scaled.shape[0]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        probs = torch.softmax(scaled, dim=-1)
        order = torch.sort(probs, descending=True, stable=True).indices
        sorted_probs = probs[order]
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass strictly before each token
        drop = order[before >= params.top_p]
        scaled[drop] = float("-inf")
    return scaled


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a plain run samples from: [vocab] fp32 (one-hot at the argmax when greedy)."""
    if params.greedy:
        return torch.nn.functional.one_hot(torch.argmax(logits.cpu()), logits.shape[-1]).float()
    return torch.softmax(masked_logits(logits, params), dim=-1)


def choose(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """The token a plain run places at `position` given the logits row [vocab] that predicts it."""
    if params.greedy:
        return int(torch.argmax(logits))
    if logits.is_cuda:
        return int(choose_rows(logits[None], [params], [position])[0])
    return int(torch.argmax(masked_logits(logits, params) + gumbel(params.seed, position, logits.shape[-1])))


def choose_rows(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> torch.Tensor:
    """The device path of coupled sampling: logits [R, vocab] (row r sampled with params[r] for the
    token at positions[r], temperature > 0) -> int64 [R] chosen ids, on the logits' device."""
    if logits.dim() != 2 or len(params) != logits.shape[0] or len(positions) != logits.shape[0]:
        raise ValueError(f"choose_rows: logits {list(logits.shape)} need one params and one position per row, "
                         f"got {len(params)} params and {len(positions)} positions")
    if any(p.greedy for p in params):
        raise ValueError("choose_rows: params has a greedy row (temperature 0); greedy rows take the argmax")
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32).to(device)
    seeds = torch.tensor([seed_as_int64(p.seed) for p in params], dtype=torch.int64).to(device)
    position_ids = torch.tensor(positions, dtype=torch.int64).to(device)
    threshold = None
    if any(masks_on(p, logits.shape[1]) for p in params):
        threshold = keep_thresholds(logits.float() / temperature[:, None], params)
    return pick(coupled_choice, coupled_choice_ref, logits)(logits, temperature, seeds, position_ids, threshold)


def keep_threshold(scaled: torch.Tensor, params: SamplingParams,
                   limits: tuple[torch.Tensor | None, torch.Tensor | None] | None = None) -> torch.Tensor:
    """scaled [vocab] fp32 (logits / T) -> 0-dim fp32 on its device: `keep_thresholds` of one row."""
    return keep_thresholds(scaled[None], [params], limits)[0]


def mask_limits(params: list[SamplingParams], vocab: int, device: torch.device | str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Each row's top-k [R] int64 (0: off) and top-p [R] fp32 (1: off) on `device`, None where no
    row uses that mask: what keep_thresholds reads. Made once outside a CUDA graph, they let a
    capture take the thresholds without a copy from the host inside it."""
    top_k = _top_ks(params, vocab)
    k = torch.tensor(top_k, dtype=torch.int64).to(device) if any(top_k) else None
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32).to(device) if any(p.top_p < 1.0 for p in params) else None
    return k, top_p


def _top_ks(params: list[SamplingParams], vocab: int) -> list[int]:
    """Each row's top-k, 0 where it removes nothing (off, or not below the vocabulary)."""
    return [p.top_k if p.top_k and p.top_k < vocab else 0 for p in params]


def keep_thresholds(scaled: torch.Tensor, params: list[SamplingParams],
                    limits: tuple[torch.Tensor | None, torch.Tensor | None] | None = None) -> torch.Tensor:
    """scaled [R, vocab] fp32 (logits / T), row r masked as params[r] says -> [R] fp32 on its device:
    the smallest scaled logit each row's top-k / top-p masks keep (-inf when neither is on); the
    kept ids are those >= it.

    masked_logits' rules computed on the device for every row at once, without a host sync. Ties at
    the cut stay in (top-k as on the host; top-p keeps every id tied with the last one its prefix
    needs, where the host keeps the lower ids of a tie only). Row invariance: each op works along
    its own row: a top-k selection and a sort (exact), a softmax (per-row order fixed by the
    vocabulary size), and the running sum of kernels/sampling.py's cumsum_rows (torch's CUDA cumsum
    changes a row's bits with the row count); tests/kernel_tests/test_sampling.py checks rows
    alone against rows in batches on the GPU. limits: mask_limits(params, vocab, device), when made
    beforehand (a CUDA graph's capture)."""
    rows, vocab = scaled.shape
    k, top_p = mask_limits(params, vocab, scaled.device) if limits is None else limits  # [R] each, or None
    threshold = scaled.new_full((rows,), float("-inf"))
    if k is not None:
        largest = torch.topk(scaled, max(_top_ks(params, vocab)), dim=-1).values  # [R, max k] descending
        kth = largest.gather(1, (k - 1).clamp(min=0)[:, None])[:, 0]
        threshold = torch.where(k > 0, kth, threshold)
    if top_p is not None:
        ordered = torch.sort(torch.where(scaled >= threshold[:, None], scaled, float("-inf")), dim=-1, descending=True).values
        probs = torch.softmax(ordered, dim=-1)
        # mass strictly before each token (an exclusive running sum over the sorted row): the
        # count of tokens whose mass before is < p locates the cut
        running = pick(cumsum_rows, cumsum_rows_ref, probs)(probs)
        before = torch.cat([probs.new_zeros(rows, 1), running[:, :-1]], dim=1)
        kept = (before < top_p[:, None]).sum(dim=-1).clamp(min=1)  # [R]
        cut = ordered.gather(1, (kept - 1)[:, None])[:, 0]
        threshold = torch.where(top_p < 1.0, torch.maximum(threshold, cut), threshold)
    return threshold


def masks_on(params: SamplingParams, vocab: int) -> bool:
    """Whether top-k or top-p removes anything from a vocabulary of `vocab` ids."""
    return bool(params.top_k and params.top_k < vocab) or params.top_p < 1.0


def seed_as_int64(seed: int) -> int:
    """A uint64 seed as the int64 with the same bits (the kernel hashes the bits)."""
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def sample_from(probs: torch.Tensor, seed: int, position: int, stream: int) -> int:
    """An exact sample of probs [vocab] (Gumbel-max on log probs), keyed by (seed, position, stream)."""
    return int(torch.argmax(torch.log(probs) + gumbel(seed, position, probs.shape[-1], stream)))
