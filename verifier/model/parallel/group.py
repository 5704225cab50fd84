"""TensorParallel: one rank's view of a tensor-parallel group and the three cross-rank operations
the sharded model needs.
The design in full: DESIGN.md section 10, "The tensor-parallel group".
"""

from __future__ import annotations

import torch

from hybrid_kernels.linear import SplitSums
from hybrid_kernels.moe_grouped import PendingCombine


def split_evenly(n: int, size: int, what: str) -> int:
    """n units split over `size` ranks -> the units per rank; ValueError naming `what` when n is
    not a multiple of size (every split here is even: each rank the same shapes and work)."""
    if n % size:
        raise ValueError(f"tensor parallelism over {size} ranks: {what} {n} is not divisible by {size}")
    return n // size


class TensorParallel:
    """Rank `rank` of `size` ranks in the torch.distributed process group `group` (None: the
    default group). size 1 runs no collective: its model is the plain model, bit for bit."""

    def __init__(self, rank: int, size: int, group=None):
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"tensor parallelism: rank {rank} is not within 0 .. size - 1 for size {size}")
        self.rank, self.size, self.group = rank, size, group

    def __repr__(self) -> str:
        return f"TensorParallel(rank={self.rank}, size={self.size})"

    def shard(self, n: int, what: str) -> range:
        """This rank's contiguous range of n units (heads, channels, vocabulary rows); ValueError
        naming `what` when n is not divisible by the size."""
        per_rank = split_evenly(n, self.size, what)
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def vocab_rows(self, vocab: int) -> range:
        """This rank's rows of a vocabulary of `vocab` ids split into `size` parts of cdiv(vocab, size)
        rows each: ids rank * part .. (rank + 1) * part. Past the last id (the last ranks, when size
        does not divide vocab) the rows are padding: zero rows no id looks up, whose logits
        `HybridModel.forward` cuts away before anything reads them."""
        part = -(-vocab // self.size)
        return range(self.rank * part, (self.rank + 1) * part)

    def gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's x (the same shape and dtype on all), in rank order: copies, exact."""
        if self.size == 1:
            return [x]
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return parts

    def sum(self, x: torch.Tensor | SplitSums | PendingCombine) -> torch.Tensor:
        """The ranks' partials added in rank order: ((x_0 + x_1) + x_2) + ... (DESIGN.md section 10, "The tensor-parallel group").
        A split-K product or grouped experts still owed their reduce or combine (CUDA's
        into_add_norm hand-over) are finished first."""
        if isinstance(x, (SplitSums, PendingCombine)):
            x = x.finish()
        if self.size == 1:
            return x
        parts = self.gather(x)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., v] on each rank -> [..., size * v]: rank 0's columns first."""
        if self.size == 1:
            return x
        return torch.cat(self.gather(x), dim=-1)

    def embed(self, table: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Rows of a vocabulary-split embedding: table [part, H] holds ids rank * part .. (`vocab_rows`);
        tokens [rows] int64 ids of the whole vocabulary -> [rows, H], the same on every rank."""
        if self.size == 1:
            return table[tokens]
        rows = table.shape[0]
        local = tokens - self.rank * rows
        owned = (local >= 0) & (local < rows)
        looked_up = table[local.clamp(0, rows - 1)]  # [rows, H]; rows owned elsewhere zeroed next
        return self.sum(looked_up.masked_fill(~owned[:, None], 0))
