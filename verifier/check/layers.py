"""Per-layer attribution for `python -m verifier check`: each block's mixer and MLP output rows,
recorded while a check runs steps, so a differing logit row can be traced to the first layer kind
whose output differs.

The model has no hooks, so while the recorder is active each block's `mixer.forward` and
`mlp.forward` are shadowed by instance attributes that call the method and keep a copy of its
output; leaving the `with` deletes them. Eager engines only: a CUDA graph replays its kernels
without running this Python. Under tensor parallelism a rank records its own partial sums (the
cross-rank sum runs after the mixer and the MLP): each rank compares its part, and the verdicts
are agreed across the ranks (results.agree).
"""

from __future__ import annotations

import torch

from hybrid_kernels.linear import SplitSums
from hybrid_kernels.moe_grouped import PendingCombine


class LayerOutputs:
    def __init__(self, model):
        config = model.config
        self.model = model
        # (object whose forward is recorded, its kind): per block its mixer, then its MLP
        self.parts = [part for i, block in enumerate(model.blocks)
                      for part in ((block.mixer, f"{config.mixers[i]} mixer"), (block.mlp, f"{config.mlps[i]} mlp"))]
        self._calls: list[list[torch.Tensor]] = [[] for _ in self.parts]

    @property
    def kinds(self) -> list[str]:
        return [kind for _, kind in self.parts]

    def __enter__(self) -> LayerOutputs:
        for index, (owner, _) in enumerate(self.parts):
            owner.forward = self._recording(owner.forward, index)
        return self

    def __exit__(self, *exc) -> None:
        for owner, _ in self.parts:
            vars(owner).pop("forward", None)  # the class's method shows again
        self.take()

    def _recording(self, forward, index: int):
        def recorded(*args, **kwargs):
            out = forward(*args, **kwargs)
            # a mixer returns (rows, its verify record); SplitSums, a split-K projection's sums, and
            # PendingCombine, grouped experts before their combine, which the next norm finishes
            # (ops.linear, ops.routed_experts), are tuples too, so they are told apart first
            owed = (SplitSums, PendingCombine)
            rows = out if isinstance(out, owed) else out[0] if isinstance(out, tuple) else out
            if isinstance(rows, owed):
                rows = rows.finish()
            self._calls[index].append(rows.detach().clone())
            return out

        return recorded

    def take(self) -> list[torch.Tensor]:
        """Per part, its output rows [rows, hidden] since the last take, in row order (the reference
        backend calls the MLP once per row, the kernels once per step: both concatenate the same)."""
        out = [torch.cat(calls) if calls else torch.empty(0) for calls in self._calls]
        self._calls = [[] for _ in self.parts]
        return out
