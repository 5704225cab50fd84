"""The model drafter: a small checkpoint run locally through our own engine, kept in step with the
accepted stream.
The design in full: DESIGN.md section 9, "The model drafter".
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from ..engine import Engine
from ..model import HybridModel, load_config, load_model
from ..model.device_scope import device_scope, on_model_device
from ..model.rollback import WOA
from ..params import STREAM_DRAFT, SamplingParams
from ..sampling import choose, masked_logits, sample_from
from .draft_chain import BONUS, NONE, RESTORE_BONUS, TWO, DraftChain

log = logging.getLogger(__name__)

REJECTION, COUPLED = "rejection", "coupled"

_DTYPES = {"cpu": torch.float32, "cuda": torch.bfloat16}
DRAFT_GRAPH_ROWS = (1, 2, 3, 4, 6, 8, 12, 16)  # a context that grows by more runs eagerly
CHAIN_MAX_K = 8  # drafts per proposal the chain graphs cover (the server's default max_k); more run the loop


class ModelProposer:
    def __init__(self, model: HybridModel, vocab_size: int, max_context: int, sampling: SamplingParams = SamplingParams(),
                 seed: int = 0, mode: str = REJECTION, draft_chain: bool | None = None):
        """draft_chain: draft greedy and coupled proposals through one graph replay each
        (draft_chain.py); None: where the engine runs CUDA graphs. True without graphs runs the
        chain's body eagerly (tests of its buffers on the CPU); False: the eager loop always."""
        _check_vocab(model.config.vocab_size, vocab_size)
        if mode not in (REJECTION, COUPLED):
            raise ValueError(f"mode must be {REJECTION!r} or {COUPLED!r}, got {mode!r}")
        if max_context < 2:
            raise ValueError(f"max_context must be at least 2, got {max_context}")
        self.model = model
        self.params = sampling
        self.seed, self.mode = seed, mode
        # one slot; the context the verifier allows, so any context it can send fits. A step consumes
        # the bonus (and the last draft when all were accepted) or one draft: few rows, so few graph
        # buckets, captured now rather than on the first proposals (a 152k vocabulary's 512-row
        # bucket alone would hold 300 MiB of logits)
        rows = tuple(r for r in DRAFT_GRAPH_ROWS if r <= max_context)
        self.engine = Engine(model, n_slots=1, max_seq_len=max_context, max_k=0, rollback_mode=WOA, graph_rows=rows)
        self.engine.warm_up()
        self.slot: int | None = None
        self.tokens: list[int] = []  # consumed into the slot: positions 0 .. len - 1
        self.logits: torch.Tensor | None = None  # [vocab] predicting the token at position len(tokens)
        self._snapshots: dict[int, tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]] = {}
        self._chain_start: int | None = None  # where the last chained proposal started (its boundaries are the snapshots)
        self.prefills = 0  # how many times the whole context was prefilled (tests: only at the start)
        self.rows = 0  # rows consumed by decode-path forwards after the prefills
        with device_scope(model.device):  # the chain's eager run and captures (verifier/model/device_scope.py)
            self.chain = self._draft_chain(draft_chain, min(CHAIN_MAX_K, max_context))

    @classmethod
    def from_dir(cls, model_dir: str | Path, vocab_size: int, max_context: int, sampling: SamplingParams = SamplingParams(),
                 device: str = "cpu", seed: int = 0, mode: str = REJECTION, draft_chain: bool | None = None) -> "ModelProposer":
        """Load the checkpoint at `model_dir` (fp32 on the CPU, bf16 on a GPU) for a target of
        `vocab_size` ids whose sessions hold at most `max_context` tokens."""
        _check_vocab(load_config(model_dir).vocab_size, vocab_size)  # before reading any weights
        return cls(load_draft_model(model_dir, device), vocab_size, max_context, sampling, seed, mode, draft_chain)

    def _draft_chain(self, wanted: bool | None, max_k: int) -> DraftChain | None:
        graphed = self.engine.graphed
        # rejection-sampled drafts are drawn on the host (with their q): the loop; coupled noise is
        # drawn on the device only on CUDA
        chained = self.params.greedy or (self.mode == COUPLED and graphed)
        if not chained or wanted is False or (wanted is None and not graphed):
            return None
        # a pool of one slot hands out slot 0 on every admit (checked in _draft_chained)
        return DraftChain(self.engine, 0, max_k, self.params)

    @property
    def max_seq_len(self) -> int:
        return self.engine.max_seq_len

    @property
    def graph_captures(self) -> int:
        """CUDA graphs captured since construction: the engine's buckets and the draft chains."""
        return self.engine.graph_captures + (self.chain.captures if self.chain is not None else 0)

    # -- the proposer protocol --------------------------------------------------------------

    def propose(self, context: list[int], k: int) -> list[int]:
        return self.propose_with_probs(context, k)[0]

    @on_model_device
    def propose_with_probs(self, context: list[int], k: int) -> tuple[list[int], np.ndarray | None]:
        """Up to k drafts after `context`, and their distributions q [len, vocab] float32 when the
        session samples in rejection mode (else None: the drafts are deterministic given the logits)."""
        # Consuming d1 .. d(k-1) must stay inside the slot: len(context) + k - 1 <= max_seq_len.
        k = min(k, self.max_seq_len - len(context) + 1)
        if k <= 0 or not context:
            return [], None
        if self.chain is not None and k <= self.chain.max_k:
            caught = self._catch_up_in_chain(context, k)
            if caught is not None:
                return caught, None
            return self._draft_chained(self.sync(context), k), None
        logits = self.sync(context)
        send_q = not self.params.greedy and self.mode == REJECTION
        drafts, probs = [], []
        for i in range(k):
            position = len(self.tokens)  # where the draft will sit
            draft, q = self._choose(logits, position)
            drafts.append(draft)
            if send_q:
                probs.append(q)
            if i + 1 < k:  # the last draft is consumed only if the verifier keeps it
                self._chain_start = None  # these snapshots are clones, not chain boundaries
                self._snapshots[len(self.tokens)] = (self._save(), logits)
                logits = self._consume([draft])
        return drafts, (np.stack(probs) if send_q else None)

    def _draft_chained(self, logits: torch.Tensor, k: int) -> list[int]:
        """The drafting loop's drafts, snapshots and end state, from one chain replay."""
        # The replay overwrites the chain's boundary buffers, which the last proposal's snapshots
        # are views of: sync has settled (restored or dropped) them all by now.
        assert not self._snapshots, "a draft chain replay would overwrite snapshots that sync has not settled"
        assert self.slot == self.chain.slot, f"the draft chain serves slot {self.chain.slot}, the drafter holds {self.slot}"
        return self._chained(k, self.chain.propose(logits, len(self.tokens), k))

    def _chained(self, k: int, drafts: list[int]) -> list[int]:
        """Record a chain's proposal of k drafts from position len(self.tokens): its boundaries
        are the snapshots, drafts[0 .. k-2] are consumed, the chain's logits predict the next."""
        start = self._chain_start = len(self.tokens)
        for i in range(k - 1):
            self._snapshots[start + i] = self.chain.boundary(i)
        self.tokens += drafts[:-1]
        self.rows += k - 1
        self.logits = self.chain.logits
        return drafts

    def _catch_up_in_chain(self, context: list[int], k: int) -> list[int] | None:
        """The proposal with the sync inside the chain's replay (draft_chain.py, "Catching up"):
        when the context is the last proposal's context plus the verifier's answer (the kept drafts
        and a bonus), restore and consume are the replay's first nodes. None: the context needs the
        eager sync (a restart, or more new tokens than a catch-up takes)."""
        if self.slot is None or len(context) > self.max_seq_len:
            return None
        agree = _common_prefix(self.tokens, context)
        restore = None
        if agree < len(self.tokens):  # the slot consumed a rejected draft: back to a boundary of the last chain
            kept = [n for n in self._snapshots if n <= agree]
            if not kept or self._chain_start is None:
                return None
            length = max(kept)
            restore = length - self._chain_start  # the boundary's index in the chain
        else:
            length = len(self.tokens)
        new = tuple(context[length:])
        if restore is not None:
            kind = RESTORE_BONUS if len(new) == 1 else None
        else:
            kind = {0: NONE, 1: BONUS, 2: TWO}.get(len(new))
        if kind is None or kind not in self.chain.catch_ups:
            return None
        # the catch-up reads the last proposal's boundaries before the replay overwrites them
        self._snapshots.clear()
        logits = self.logits if kind == NONE else None
        drafts = self.chain.propose(logits, len(context), k, kind, new, restore or 0)
        self.tokens = self.tokens[:length] + list(new)
        self.rows += len(new)
        return self._chained(k, drafts)

    # -- keeping in step ---------------------------------------------------------------------

    @on_model_device
    def sync(self, context: list[int]) -> torch.Tensor:
        """Bring the slot to `context` consumed; return the logits [vocab] predicting the next token
        (with a draft chain possibly a view of its buffers: valid until the next proposal)."""
        if len(context) > self.max_seq_len:
            raise ValueError(f"context of {len(context)} tokens passes the draft slot's max_seq_len {self.max_seq_len}")
        agree = _common_prefix(self.tokens, context)
        if agree < len(self.tokens):
            # The slot consumed drafts the verifier rejected: back to the latest snapshot inside the
            # agreed prefix, or, for a context that is no extension at all, a fresh prefill.
            kept = [n for n in self._snapshots if n <= agree]
            if kept:
                self._restore(max(kept))
            else:
                return self._restart(context)
        elif self.slot is None:
            return self._restart(context)
        self._snapshots.clear()  # they belong to the branch just settled
        if len(context) > len(self.tokens):
            self.logits = self._consume(context[len(self.tokens):])
        return self.logits

    def _restart(self, context: list[int]) -> torch.Tensor:
        if self.slot is not None:
            self.engine.release(self.slot)
            self.slot = None
        self._snapshots.clear()
        self.slot = self.engine.admit()
        self.prefills += 1
        # Prefill all but the last token and decode that one, as the verifier does with a prompt and
        # its first token: a drafter of the target's own checkpoint then holds the target's bits.
        self.tokens = list(context[:-1])
        if self.tokens:
            self.engine.prefill(self.slot, self.tokens)
        return self._consume([context[-1]])

    def _consume(self, new: list[int]) -> torch.Tensor:
        """Consume `new` at the slot's position through the decode path (verify, then rollback
        keeping every row); return the last row's logits."""
        last = self.engine.consume(self.slot, len(self.tokens), new)  # graphed or eager, as the engine's steps
        self.tokens += new
        self.rows += len(new)
        self.logits = last
        return last

    def _save(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.engine.save_recurrent(self.slot)

    def _restore(self, length: int) -> None:
        saved, logits = self._snapshots[length]
        self.engine.restore_recurrent(self.slot, saved)
        self.tokens = self.tokens[:length]
        self.logits = logits

    # -- choosing a draft --------------------------------------------------------------------

    def _choose(self, logits: torch.Tensor, position: int) -> tuple[int, np.ndarray | None]:
        if self.params.greedy or self.mode == COUPLED:
            return choose(logits, self.params, position), None
        q = torch.softmax(masked_logits(logits, self.params), dim=-1)
        return sample_from(q, self.seed, position, STREAM_DRAFT), q.numpy().astype(np.float32)


def _check_vocab(draft: int, served: int) -> None:
    if draft != served:
        raise ValueError(f"--draft-model: the draft model's vocab_size {draft} differs from the served model's "
                         f"{served}; a drafter must share the target's vocabulary")


def _common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix, by slice comparisons (in C) that halve the span
    holding the first difference: a context of thousands of tokens costs a few, not a Python loop."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    agreed, differs = 0, n  # a[:agreed] == b[:agreed]; the first difference is before index `differs`
    while differs - agreed > 1:
        middle = (agreed + differs) // 2
        if a[agreed:middle] == b[agreed:middle]:
            agreed = middle
        else:
            differs = middle
    return agreed


_LOADED: dict[tuple[str, str], HybridModel] = {}


def load_draft_model(model_dir: str | Path, device: str = "cpu") -> HybridModel:
    """The draft checkpoint, loaded once per (directory, device): a bench builds a fresh proposer
    per sequence, and they share the weights (the state lives in each proposer's own pool)."""
    device = str(device)
    kind = device.split(":")[0]
    if kind not in _DTYPES:
        raise ValueError(f"--draft-device must be cpu, cuda or cuda:N, got {device!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("--draft-device cuda, but torch sees no CUDA device")
    key = (str(Path(model_dir).resolve()), device)
    if key not in _LOADED:
        model = load_model(model_dir, device, _DTYPES[kind])
        log.info("loaded the draft model %s on %s", model_dir, device)
        if kind == "cuda":
            # The first forwards on a GPU compile the Triton kernels (most of a second): do it here,
            # not inside the first timed generation. A throwaway proposer with its own small pool.
            ModelProposer(model, model.config.vocab_size, 16).propose([0] * 4, 3)
        _LOADED[key] = model
    return _LOADED[key]
