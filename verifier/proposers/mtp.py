"""The MTP drafter: the checkpoint's own multi-token-prediction head (verifier/model/mtp.py) drafting
from the target's hidden rows, in process and on the server, for one sequence or many at once.
Its inputs, state, the batched proposal (catch-up, recurrent drafts), positions, how drafts are
chosen, the bits and failures: DESIGN.md section 9, "MTP drafting".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from hybrid_kernels.runtime import pick
from hybrid_kernels.sampling import argmax_rows, argmax_rows_ref

from ..model.device_scope import device_scope
from ..model.mtp import MTPHead
from ..model.rows import RowBatch
from ..params import STREAM_DRAFT, SamplingParams
from ..sampling import choose, choose_rows, masked_logits, sample_from
from .model import COUPLED, REJECTION
from .mtp_chain import MTP_CHAIN_MAX_K, MTPChain

# Past this many sequences in one proposal the batched forwards beat a chain replay per sequence: a
# replay costs about its drafts' LM head reads, the batched pass a launch-bound eager pass whatever
# its sequences (bench.fp8_real_size's MTP figure times both at one sequence). The drafts are the same.
MTP_CHAIN_MAX_SEQUENCES = 8

log = logging.getLogger(__name__)

Drafted = tuple[list[int], "np.ndarray | None"]  # (drafts, q [len(drafts), vocab] float32 or None)


@dataclass
class MTPTrack:
    """One sequence's place in an MTPDrafter: its slot, and the hidden rows the head has not fed."""

    slot: int
    known: int = 0  # hidden rows observed: positions 0 .. known - 1
    fed: int = 0  # the slot's KV rows 0 .. fed - 1 hold (hidden q, token q + 1) of the accepted stream
    held_from: int = 0  # the position of the first held row
    # hidden rows of positions held_from .. known - 1, in order ([n, H] each): those not fed yet,
    # and the last fed one (a repeated proposal re-feeds it)
    held: list[torch.Tensor] = field(default_factory=list)

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """The hidden rows of positions start .. stop - 1: [stop - start, H]."""
        assert self.held_from <= start <= stop <= self.known, (self.held_from, start, stop, self.known)
        if len(self.held) > 1:  # one tensor from now on: the next call slices it
            self.held = [torch.cat(self.held)]
        return self.held[0][start - self.held_from : stop - self.held_from]

    def fed_to(self, p: int) -> None:
        """The catch-up fed rows up to p - 1: keep row p - 1 alone (a copy: the buffers it came
        from, the prompt's or a step's, are then free)."""
        last = self.rows(p - 1, p).clone()
        self.held, self.held_from, self.fed = [last], p - 1, p


@dataclass(frozen=True)
class MTPAsk:
    """One sequence's request for up to k drafts after `context` (its prompt and every emitted
    token; its last one the pending token), chosen as `mode` says for `params`."""

    track: MTPTrack
    context: list[int]
    k: int
    params: SamplingParams = SamplingParams()
    seed: int = 0  # rejection mode's own noise (STREAM_DRAFT)
    mode: str = COUPLED
    chain: MTPChain | None = None  # the sequence's MTP chain (one graph replay a proposal), if it has one

    @property
    def pending(self) -> int:
        """The pending token's position p."""
        return len(self.context) - 1

    @property
    def sends_q(self) -> bool:
        return self.mode == REJECTION and not self.params.greedy


class MTPDrafter:
    """The MTP head with a KV pool of n_slots slots (slot s paired with the engine's slot s)."""

    def __init__(self, head: MTPHead, n_slots: int, max_seq_len: int):
        """max_seq_len: the engine's (its pool's): the most positions a sequence reaches."""
        self.head = head
        self.n_slots = n_slots
        self.max_seq_len = max_seq_len
        # [n_slots + 1 (scratch), max_seq_len] KV rows per MTP layer; slots are named, not admitted
        # (attention needs no reset: a catch-up writes every row before any row reads it)
        self.pool = head.new_pool(n_slots, max_seq_len)
        self.graphed = torch.device(head.device).type == "cuda"
        # every chain's graphs in one memory pool: chains replay one at a time on the worker's stream
        self.graph_memory = torch.cuda.graph_pool_handle() if self.graphed else None
        self._chains: dict[int, MTPChain] = {}  # slot -> the chain its last sequence drafted with

    def chain(self, slot: int, params: SamplingParams) -> MTPChain:
        """The MTP chain of `slot` choosing as `params` says: the slot's last one when it chose so
        (a new session in the slot then replays the graphs already captured: a capture costs far
        more than a proposal), else a new one, which replaces it."""
        chain = self._chains.get(slot)
        if chain is None or chain.choose.params != params:
            chain = MTPChain(self.head, self.pool, slot, MTP_CHAIN_MAX_K, params, graphed=self.graphed,
                             memory=self.graph_memory)
            self._chains[slot] = chain
        return chain

    def track(self, slot: int, prompt_hidden: torch.Tensor) -> MTPTrack:
        """A new sequence in `slot`, whose prompt rows' hidden rows are prompt_hidden [len(prompt), H]."""
        if not 0 <= slot < self.n_slots:
            raise ValueError(f"MTP drafter: slot {slot} is outside its pool of {self.n_slots} slots")
        track = MTPTrack(slot)
        self.observe(track, prompt_hidden)
        return track

    def observe(self, track: MTPTrack, hidden: torch.Tensor) -> None:
        """The hidden rows [n, H] of the next n positions the target consumed (a step's StepResult.hidden),
        kept by reference until the next proposal feeds them."""
        H = self.head.config.hidden_size
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or hidden.shape[1] != H:
            shape = list(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
            raise ValueError(f"MTP drafter: hidden rows must be [rows, {H}], got {shape}")
        n = hidden.shape[0]
        if track.known + n > self.max_seq_len:
            raise ValueError(f"MTP drafter: {track.known} + {n} hidden rows pass max_seq_len {self.max_seq_len}")
        if n:
            track.held.append(hidden)
            track.known += n

    def proposer(self, slot: int, sampling: SamplingParams = SamplingParams(), seed: int = 0,
                 mode: str = COUPLED, chain: bool | None = None) -> "MTPProposer":
        """A proposer for the sequence in `slot` that drafts through this drafter's pool (with its
        own MTP chain on CUDA unless chain=False: MTPProposer)."""
        return MTPProposer(self.head, self.max_seq_len, sampling, seed, mode, drafter=self, slot=slot, chain=chain)

    # -- proposing -----------------------------------------------------------------------------

    def propose(self, asks: list[MTPAsk]) -> list[Drafted | Exception]:
        """Each ask's drafts (and q in rejection mode), proposed together (DESIGN.md section 9, "MTP drafting"), or
        the exception that ask alone raised: a wrong ask, or a forward that failed for it."""
        out: list[Drafted | Exception] = [([], None) for _ in asks]
        drafting = []  # indices of the asks that draft
        slots = set()
        for i, ask in enumerate(asks):
            try:
                if self._check(ask):
                    if ask.track.slot in slots:  # two sequences cannot share the slot's KV rows
                        raise ValueError(f"MTP drafter: slot {ask.track.slot} asked for twice in one proposal")
                    slots.add(ask.track.slot)
                    drafting.append(i)
            except Exception as exc:  # noqa: BLE001 - a wrong ask fails alone
                out[i] = exc
        if not drafting:
            return out
        if len(drafting) <= MTP_CHAIN_MAX_SEQUENCES:  # each through its chain where one fits (the same drafts)
            eager = []
            for i in drafting:
                try:
                    chained = self._chained(asks[i])
                except Exception as exc:  # noqa: BLE001 - that sequence's own failure
                    chained = exc
                if chained is None:
                    eager.append(i)
                else:
                    out[i] = chained
            drafting = eager
            if not drafting:
                return out
        try:
            drafted = self._draft([asks[i] for i in drafting])
        except Exception as exc:  # noqa: BLE001 - which sequence's? each alone tells (and gets its drafts)
            if len(drafting) == 1:
                drafted = [exc]
            else:
                log.warning("MTP drafter: a batched proposal for %d sequences failed (%r); proposing for each alone",
                            len(drafting), exc)
                drafted = [self._alone(asks[i]) for i in drafting]
        for i, result in zip(drafting, drafted):
            out[i] = result
        return out

    def _chained(self, ask: MTPAsk) -> Drafted | None:
        """A checked ask's drafts through its chain (one graph replay), or None when it has no chain,
        sends q, or its catch-up or drafts do not fit one (the batched forwards take it then)."""
        chain, track, p = ask.chain, ask.track, ask.pending
        if chain is None or ask.sends_q:
            return None
        start = min(track.fed, p - 1)  # the catch-up's rows, as _catch_up takes them
        if not chain.fits(p - start, ask.k) or p + ask.k - 2 >= self.max_seq_len:  # _draft cuts such drafts
            return None
        drafts = chain.propose(start, ask.context[start + 1 : p + 1], track.rows(start, p), ask.k)
        track.fed_to(p)
        return drafts, None

    def _alone(self, ask: MTPAsk) -> Drafted | Exception:
        try:
            return self._draft([ask])[0]
        except Exception as exc:  # noqa: BLE001 - that ask's own failure
            return exc

    def _check(self, ask: MTPAsk) -> bool:
        """ValueError naming what is wrong with an ask; False: it drafts nothing (k <= 0)."""
        track, p = ask.track, ask.pending
        if not ask.context:
            raise ValueError("MTP drafter: an empty context (it holds the prompt and the pending token at least)")
        if not 0 <= track.slot < self.n_slots:
            raise ValueError(f"MTP drafter: slot {track.slot} is outside its pool of {self.n_slots} slots")
        if ask.mode not in (COUPLED, REJECTION):
            raise ValueError(f"MTP drafter: mode must be {COUPLED!r} or {REJECTION!r}, got {ask.mode!r}")
        if len(ask.context) > self.max_seq_len:
            raise ValueError(f"MTP drafter: a context of {len(ask.context)} tokens passes max_seq_len {self.max_seq_len}")
        if track.known != p:
            raise ValueError(f"MTP drafter: hidden rows of {track.known} positions held, but a context of "
                             f"{len(ask.context)} tokens needs {p} (begin with the prompt's, then observe every step's)")
        return ask.k > 0 and p >= 1

    def _draft(self, asks: list[MTPAsk]) -> list[Drafted]:
        """The drafts of checked asks (each k >= 1), by one catch-up forward and one forward per
        further draft position, all sequences together."""
        head, pool = self.head, self.pool
        ends = [ask.pending for ask in asks]  # p per sequence
        drafts: list[list[int]] = [[] for _ in asks]
        probs: list[list[np.ndarray]] = [[] for _ in asks]
        with device_scope(head.device):
            rows, logits = self._catch_up(asks)  # [S, H], [S, vocab]: each sequence's last row
            self._choose(logits, asks, [p + 1 for p in ends], drafts, probs)
            active = list(range(len(asks)))  # the sequences `rows` holds, in its order
            for i in range(1, max(ask.k for ask in asks)):
                keep = [j for j, s in enumerate(active) if asks[s].k > i and ends[s] - 1 + i < self.max_seq_len]
                if not keep:
                    break
                if len(keep) < len(active):
                    rows = rows.index_select(0, torch.tensor(keep, device=rows.device))
                    active = [active[j] for j in keep]
                batch = RowBatch(slots=tuple(asks[s].track.slot for s in active),
                                 starts=tuple(ends[s] - 1 + i for s in active), counts=(1,) * len(active))
                tokens = torch.tensor([drafts[s][-1] for s in active], dtype=torch.int64)
                rows, logits = head.forward(tokens, rows, batch, pool, row_invariant=True, step=i)
                self._choose(logits, [asks[s] for s in active], [ends[s] + 1 + i for s in active],
                             [drafts[s] for s in active], [probs[s] for s in active])
        return [(d, np.stack(q) if ask.sends_q else None) for ask, d, q in zip(asks, drafts, probs)]

    def _catch_up(self, asks: list[MTPAsk]) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of every sequence's rows not yet fed (at least its last one) -> each
        sequence's last output row [S, H] and its logits [S, vocab]."""
        # rows from `fed` on (at least the last one: a repeated proposal re-feeds it, the same KV row)
        starts = [min(ask.track.fed, ask.pending - 1) for ask in asks]
        tokens = [t for ask, start in zip(asks, starts) for t in ask.context[start + 1 : ask.pending + 1]]
        hidden = [ask.track.rows(start, ask.pending) for ask, start in zip(asks, starts)]
        batch = RowBatch(slots=tuple(ask.track.slot for ask in asks), starts=tuple(starts),
                         counts=tuple(ask.pending - start for ask, start in zip(asks, starts)))
        hidden = hidden[0] if len(hidden) == 1 else torch.cat(hidden)  # [rows of all sequences, H]
        out, logits = self.head.forward(torch.tensor(tokens, dtype=torch.int64), hidden, batch, self.pool,
                                        row_invariant=True, step=0)
        for ask in asks:  # their KV rows are the accepted stream's: final
            ask.track.fed_to(ask.pending)
        last = torch.tensor([end - 1 for end in batch.offsets[1:]], device=out.device)
        return out.index_select(0, last), logits.index_select(0, last)

    @staticmethod
    def _choose(logits: torch.Tensor, asks: list[MTPAsk], positions: list[int], drafts: list[list[int]],
                probs: list[list[np.ndarray]]) -> None:
        """Append each sequence's draft, chosen from its logits row [S, vocab] for the token at
        positions[s] (DESIGN.md section 9, "MTP drafting"), to drafts[s], and its q row to probs[s] in rejection mode."""
        # greedy rows, and coupled rows on the GPU, are chosen where the logits are (one copy of S ids)
        chosen = pick(argmax_rows, argmax_rows_ref, logits)(logits)  # [S] int64: each row's argmax
        coupled = [s for s, ask in enumerate(asks) if not ask.params.greedy and ask.mode == COUPLED]
        if coupled and logits.is_cuda:
            index = torch.tensor(coupled, dtype=torch.int64, device=logits.device)
            chosen.index_copy_(0, index, choose_rows(logits.index_select(0, index), [asks[s].params for s in coupled],
                                                     [positions[s] for s in coupled]))
        ids = chosen.tolist()
        for s, ask in enumerate(asks):
            if ask.params.greedy:
                pass
            elif ask.mode == COUPLED:
                if not logits.is_cuda:  # the host's coupled noise, as the target's CPU choice draws it
                    ids[s] = choose(logits[s], ask.params, positions[s])
            else:  # rejection: a sample of q, and q itself
                q = torch.softmax(masked_logits(logits[s], ask.params), dim=-1)  # [vocab] fp32 on the host
                ids[s] = sample_from(q, ask.seed, positions[s], STREAM_DRAFT)
                probs[s].append(q.numpy().astype(np.float32))
            drafts[s].append(ids[s])


class MTPProposer:
    """One sequence's MTP drafts: the proposer protocol (a HiddenStateProposer and a
    ProbabilityProposer) over an MTPDrafter's slot; in process, a drafter of one slot of its own."""

    def __init__(self, head: MTPHead, max_seq_len: int, sampling: SamplingParams = SamplingParams(), seed: int = 0,
                 mode: str = COUPLED, *, drafter: MTPDrafter | None = None, slot: int = 0, chain: bool | None = None):
        """max_seq_len: the engine's (its pool's): the most positions a sequence reaches. sampling:
        the session's; mode: COUPLED (the default: the stream is the plain one) or REJECTION (q
        returned for the verifier's rejection sampling); seed: rejection mode's draws. drafter:
        a shared MTPDrafter whose `slot` this sequence takes (the server's); None: a new one of
        one slot. chain: propose through an MTPChain (mtp_chain.py: one CUDA graph replay a
        proposal, the same drafts) where one fits and the drafter proposes for few sequences
        (MTP_CHAIN_MAX_SEQUENCES); None: on CUDA, for drafts without q; True on the CPU runs the
        chain's body eagerly (tests, greedy only)."""
        if mode not in (COUPLED, REJECTION):
            raise ValueError(f"mode must be {REJECTION!r} or {COUPLED!r}, got {mode!r}")
        self.drafter = drafter if drafter is not None else MTPDrafter(head, 1, max_seq_len)
        if not 0 <= slot < self.drafter.n_slots:
            raise ValueError(f"MTP drafter: slot {slot} is outside its pool of {self.drafter.n_slots} slots")
        self.slot = slot
        self.params, self.seed, self.mode = sampling, seed, mode
        self.track: MTPTrack | None = None
        sends_q = mode == REJECTION and not sampling.greedy
        graphed = self.drafter.graphed
        if chain is None:
            chain = graphed and not sends_q
        self.chain = self.drafter.chain(slot, sampling) if chain else None

    @property
    def head(self) -> MTPHead:
        return self.drafter.head

    @property
    def max_seq_len(self) -> int:
        return self.drafter.max_seq_len

    @property
    def known(self) -> int:
        """Hidden rows held: positions 0 .. known - 1."""
        return self.track.known if self.track is not None else 0

    @property
    def fed(self) -> int:
        """The head's KV rows 0 .. fed - 1 are final."""
        return self.track.fed if self.track is not None else 0

    def begin(self, prompt_hidden: torch.Tensor) -> None:
        """A new sequence, whose prompt rows' hidden rows are prompt_hidden [len(prompt), H]."""
        self.track = self.drafter.track(self.slot, prompt_hidden)

    def observe(self, hidden: torch.Tensor) -> None:
        """The hidden rows [n, H] of the next n positions the target consumed (a step's StepResult.hidden)."""
        self.drafter.observe(self._track(), hidden)

    def ask(self, context: list[int], k: int) -> MTPAsk:
        """This sequence's request, for MTPDrafter.propose with others'."""
        return MTPAsk(self._track(), context, k, self.params, self.seed, self.mode, self.chain)

    def propose(self, context: list[int], k: int) -> list[int]:
        """Up to k drafts for the positions after context (DESIGN.md section 9, "MTP drafting")."""
        return self.propose_with_probs(context, k)[0]

    def propose_with_probs(self, context: list[int], k: int) -> Drafted:
        """Up to k drafts after `context`, and their distributions q [len, vocab] float32 when the
        session samples in rejection mode (else None: the drafts are deterministic given the logits)."""
        (result,) = self.drafter.propose([self.ask(context, k)])
        if isinstance(result, Exception):
            raise result
        return result

    def _track(self) -> MTPTrack:
        if self.track is None:
            raise ValueError("MTP drafter: no sequence begun (begin with the prompt's hidden rows first)")
        return self.track
