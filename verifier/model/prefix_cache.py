"""Prompt prefixes already ingested, kept as the slot state at prefill's chunk boundaries, so a
prompt that starts with one restores that state instead of computing it again, with the bits of a
cold start. The design in full: DESIGN.md section 4, "The prefix cache".
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .state import AttentionState, RecurrentState, SlotPool


@dataclass
class CacheStats:
    hits: int = 0  # opens that restored a cached prefix
    misses: int = 0  # opens that found none
    evictions: int = 0  # chunks dropped for the budget
    cached_tokens: int = 0  # prompt tokens whose computation a hit skipped, summed
    bytes: int = 0  # the cached tensors' bytes now


@dataclass(eq=False)
class _Chunk:
    """One prefill chunk of a prompt prefix: the KV rows its positions wrote, the recurrent layers'
    state at its end, and (when kept) its rows' final hidden rows."""

    parent: "_Chunk | None"
    tokens: tuple[int, ...]
    end: int  # the boundary it ends at: a multiple of the chunk size
    kv: list[tuple[torch.Tensor, torch.Tensor] | None]  # per layer: keys, values [C, heads, d] (attention layers)
    recurrent: list[tuple[torch.Tensor, torch.Tensor]]  # per recurrent layer: conv window, state
    hidden: torch.Tensor | None  # [C, H]
    children: dict[tuple[int, ...], "_Chunk"] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        tensors = [t for pair in [*self.kv, *self.recurrent] if pair is not None for t in pair]
        if self.hidden is not None:
            tensors.append(self.hidden)
        return sum(t.numel() * t.element_size() for t in tensors)


class PrefixCache:
    """Chunks of ingested prompts in a tree keyed by their tokens (exact: a key is the chunk's tokens,
    under its parent's), bounded by `budget_bytes`, least recently used out first. `chunk` is the
    prefill's chunk size: every boundary is a multiple of it from position 0, whatever the prompt,
    so the state at a boundary is a function of the tokens before it alone. One engine's own: an
    entry never meets another model, dtype or parallel split. keep_hidden: chunks keep their rows'
    final hidden rows (what an MTP head is fed at an open)."""

    def __init__(self, chunk: int, budget_bytes: int, keep_hidden: bool = False):
        if chunk < 1 or budget_bytes < 0:
            raise ValueError(f"PrefixCache: chunk {chunk} must be positive and budget_bytes {budget_bytes} not negative")
        self.chunk, self.budget_bytes, self.keep_hidden = chunk, budget_bytes, keep_hidden
        self.stats = CacheStats()
        self._roots: dict[tuple[int, ...], _Chunk] = {}
        self._lru: OrderedDict[int, _Chunk] = OrderedDict()  # id -> chunk, least recently used first

    def longest(self, prompt: list[int], want_hidden: bool = False) -> list[_Chunk]:
        """The cached chunks of the longest prefix of `prompt` that ends at a boundary and leaves
        at least one token to prefill (the first token is chosen from the last one's logits), in
        order; [] for none (counted as a miss), or when `want_hidden` and hidden rows are not kept."""
        path: list[_Chunk] = []
        if not want_hidden or self.keep_hidden:
            children, c = self._roots, self.chunk
            while (len(path) + 1) * c <= len(prompt) - 1:
                start = len(path) * c
                node = children.get(tuple(prompt[start : start + c]))
                if node is None:
                    break
                path.append(node)
                children = node.children
        if path:
            self.stats.hits += 1
            self.stats.cached_tokens += path[-1].end
            self._touch(path)
        else:
            self.stats.misses += 1
        return path

    def restore(self, pool: SlotPool, slot: int, path: list[_Chunk], hidden_out: torch.Tensor | None = None) -> int:
        """Write the chunks' state into `slot` (just admitted: it carries no rows; prefill continues from it) -> the
        boundary it reaches. hidden_out: the prompt's [len, H] hidden rows buffer (the chunks' rows
        are copied into its first rows)."""
        end = path[-1].end
        for index, layer in enumerate(pool.layers):
            if isinstance(layer, AttentionState):
                for node in path:
                    keys, values = node.kv[index]
                    layer.keys[slot, node.end - self.chunk : node.end].copy_(keys)
                    layer.values[slot, node.end - self.chunk : node.end].copy_(values)
        pool.write_recurrent(slot, path[-1].recurrent)
        if hidden_out is not None:
            for node in path:
                hidden_out[node.end - self.chunk : node.end].copy_(node.hidden)
        return end

    def store(self, pool: SlotPool, slot: int, prompt: list[int], path: list[_Chunk], end: int,
              hidden: torch.Tensor | None = None) -> list[_Chunk]:
        """The slot has just ingested `prompt` up to boundary `end` (a multiple of the chunk, its
        chunks up to there cached as `path` or computed now): keep the chunk ending at `end` under
        `path`'s last -> `path` extended (a chunk cached already is reused, not copied again).
        hidden: the prompt's hidden rows [>= end, H] when kept."""
        c = self.chunk
        if end != (len(path) + 1) * c or end > len(prompt):  # a chunk before it was not kept (the budget): none after it is
            return path
        if not all(self._cached(node) for node in path):
            return path  # another open's store evicted a chunk of this path (the budget): none after it is kept
        tokens = tuple(prompt[end - c : end])
        children = path[-1].children if path else self._roots
        node = children.get(tokens)
        if node is None:
            if self.budget_bytes == 0:
                return path
            node = _Chunk(path[-1] if path else None, tokens, end,
                          [(layer.keys[slot, end - c : end].clone(), layer.values[slot, end - c : end].clone())
                           if isinstance(layer, AttentionState) else None for layer in pool.layers],
                          [(layer.conv[slot].clone(), layer.recurrent[slot].clone())
                           for layer in pool.layers if isinstance(layer, RecurrentState)],
                          hidden[end - c : end].clone() if self.keep_hidden and hidden is not None else None)
            if self.keep_hidden and node.hidden is None:
                return path  # a chunk without its hidden rows could not serve an MTP session
            children[tokens] = node
            self._lru[id(node)] = node
            self.stats.bytes += node.nbytes
        path = path + [node]
        self._touch(path)
        self._evict(keep=path)  # the path an open still extends stays; `trim` once it is done
        return path

    def trim(self) -> None:
        """Evict down to the budget (an open that ingested a prompt longer than it ends here)."""
        self._evict(keep=[])

    def clear(self) -> None:
        self._roots.clear()
        self._lru.clear()
        self.stats.bytes = 0

    def _cached(self, node: _Chunk) -> bool:
        """Whether `node` is still in the tree (opens ingest side by side, and one's store may evict
        a chunk of the path another is still extending: only the storing open's own path is kept)."""
        return self._lru.get(id(node)) is node

    def _touch(self, path: list[_Chunk]) -> None:
        """The path was used: its chunks most recent, each ahead of its descendants (leaf first,
        root last), so the least recently used chunk is always a leaf."""
        for node in reversed(path):
            self._lru.move_to_end(id(node))

    def _evict(self, keep: list[_Chunk]) -> None:
        """Drop least recently used leaves while over the budget (never `keep`, the path in use)."""
        kept = {id(node) for node in keep}
        while self.stats.bytes > self.budget_bytes:
            victim = next((node for key, node in self._lru.items() if key not in kept and not node.children), None)
            if victim is None:
                return
            del self._lru[id(victim)]
            siblings = victim.parent.children if victim.parent is not None else self._roots
            del siblings[victim.tokens]
            self.stats.bytes -= victim.nbytes
            self.stats.evictions += 1
