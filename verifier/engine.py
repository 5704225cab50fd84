"""The engine: sequences in slots, and one step for decode and verify.

A step takes a ragged batch of sequences, each with its pending token and 0..max_k drafts, runs
the K+1 rows of every sequence through one row-invariant forward (decode_k), accepts per
sequence, rolls each slot back to its accepted prefix and returns per-sequence results. Decode
is a step with no drafts. The engine knows nothing of gRPC or sessions.

Checks: the engine checks state (a finished sequence, room in the context, the same sequence
twice in one step) and answers a StepError for that request alone. What a caller sends (ids in
the vocabulary, at most max_k drafts, draft probabilities of the right shape, a non-empty prompt
that fits) is the caller's to check: the server validates the wire fields, the in-process path its
own arguments; here a violation is an assertion, a caller bug.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence as Seq

import torch

from hybrid_kernels.delta_rule_chunked import CHUNK as DELTA_RULE_CHUNK
from hybrid_kernels.sampling import argmax_rows

from .acceptance import accept
from .model import HybridModel, RowBatch
from .model.device_scope import device_scope, on_model_device
from .model.graphs import DEFAULT_GRAPH_ROWS, graphs_supported, reachable_rows
from .model.hybrid import PREFILL_CHUNK
from .model.padding import check_graph_rows
from .model.prefix_cache import PrefixCache
from .model.rollback import WOA, rollback_named
from .model.sizes import DEFAULT_MAX_K  # the engine's, the server's, generate's and check's
from .model.state import AttentionState, RecurrentState
from .model.step import FixedStep, PromptRows, Step, StepGraph, StepRunner
from .params import SamplingParams
from .sampling import choose, choose_rows

EOS, LENGTH = "eos", "length"

# Most bytes of logits a step copies before its acceptance (Engine._copy_early): every row of the
# sequences that want theirs, emitted or not. 64 MiB: a decode of 64 sequences of the 2B model's
# 248k-word vocabulary, or a verify of 7 sequences x 9 rows; past it only the emitted rows are
# copied, after the acceptance.
EARLY_LOGITS_BYTES = 64 << 20

# A piece of a prompt chunk (a step that takes prompts in: Engine.step's piece) ends at a multiple
# of this from position 0 unless its chunk or prompt ends first: the chunked delta rule's sub-chunks
# sit at those multiples, so a chunk taken in pieces walks the sub-chunks a whole chunk walks.
PIECE_ALIGN = DELTA_RULE_CHUNK


class StepError(ValueError):
    """A step that cannot run. `code` says which kind (the service maps it to a status)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code  # "failed_precondition" (finished) | "out_of_range" (context) | "invalid_argument" (twice in a step)


@dataclass
class Sequence:
    slot: int
    position: int  # committed position p: tokens consumed into the slot
    pending: int  # the last emitted token, not yet consumed
    sampling: SamplingParams
    max_new_tokens: int
    eos_ids: frozenset[int]
    emitted: int = 1  # tokens emitted so far, the first one (chosen from the prompt) included
    finish_reason: str | None = None
    first_logits: torch.Tensor | None = field(default=None, repr=False)  # [vocab] the first token came from (model's device)
    # opened with want_hidden: [len(prompt), H] every prompt row's final-normed hidden row (an MTP head's input)
    prompt_hidden: torch.Tensor | None = field(default=None, repr=False)
    # an engine step failed midway with this sequence in it: a decode's verify commits its row, and
    # any verify the rows its slot carried (kernels/one_row_commit.py, model/rollback.py), so the state
    # may be past the position and the carried count stale; it steps no more
    lost: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StepRequest:
    sequence: Sequence
    drafts: list[int]
    draft_probs: torch.Tensor | None = None  # [K, vocab]: rejection sampling; None: greedy / coupled
    want_logits: bool = True  # False: the result's logits is None and no logits row is copied
    want_hidden: bool = False  # True: the result's hidden holds its consumed rows' final-normed hidden rows


@dataclass
class StepResult:
    # drafts the target agreed with, counted before the cut at eos or the token budget: at such a
    # cut `tokens` may hold fewer than accepted + 1
    accepted: int
    tokens: list[int]  # emitted: accepted drafts then the bonus, cut at eos / the budget
    position: int  # the new committed position
    finish_reason: str | None
    # [len(tokens), vocab] fp32 on the model's device: row i is what tokens[i] was chosen from
    # (None when the request did not want logits)
    logits: torch.Tensor | None
    error: StepError | None = None
    # with want_hidden: [len(tokens), H] the final-normed hidden rows (the LM head's input) of the
    # rows this step consumed (the pending token's, then each kept draft's): row i is the input
    # tokens[i] was chosen from, what an MTP head drafts from (verifier/proposers/mtp.py)
    hidden: torch.Tensor | None = None


def _one_range(wanted: list[tuple[StepResult, int, int]], counts: list[int]) -> bool:
    """Whether each (result, first row, rows) of `wanted` starts where the one before it ends."""
    first = wanted[0][1]
    return all(start == first + offset for (_, start, _), offset in zip(wanted, itertools.accumulate(counts, initial=0)))


def _hand_out(rows: torch.Tensor, wanted: list[tuple[StepResult, int, int]], counts: list[int]) -> None:
    """Each result of `wanted` a view of its rows of `rows`, which holds exactly the wanted rows in
    order: the whole of it for one sequence (a batch-1 step: no split), else one split."""
    if len(wanted) == 1:
        wanted[0][0].logits = rows
        return
    for (result, _, _), kept in zip(wanted, rows.split(counts)):
        result.logits = kept


class Engine:
    def __init__(self, model: HybridModel, n_slots: int, max_seq_len: int, max_k: int = DEFAULT_MAX_K, rollback_mode: str = WOA,
                 cuda_graphs: bool = True, graph_rows: tuple[int, ...] | None = None, prefix_cache_bytes: int = 0,
                 prefill_chunk: int = PREFILL_CHUNK):
        """graph_rows: the shared CUDA graph buckets' total verify rows (model/graphs.py); None: those
        of DEFAULT_GRAPH_ROWS that fit max_seq_len and that a step can reach (`reachable_rows`: a
        step runs at most n_slots x (max_k + 1) rows). A given list must fit max_seq_len. Besides
        them, a step of one sequence of up to max_k + 1 rows (at most the largest bucket's) has a
        bucket of exactly its shape.
        prefix_cache_bytes: keep ingested prompt prefixes up to this many bytes (model/prefix_cache.py;
        0: none). prefill_chunk: prompt tokens per prefill forward, the cache's boundaries."""
        rollback = rollback_named(rollback_mode)  # ValueError for a name of none
        if max_k < 0:
            raise ValueError(f"max_k must be >= 0, got {max_k}")
        if graph_rows is None:
            graph_rows = reachable_rows(tuple(r for r in DEFAULT_GRAPH_ROWS if r <= max_seq_len), n_slots * (max_k + 1))
        graph_rows = check_graph_rows(tuple(graph_rows), max_seq_len)
        self.model = model
        # write-on-accept carries each step's kept rows into the next verify instead of folding them (model/rollback.py)
        self.pool = model.new_pool(n_slots, max_seq_len, carry_rows=rollback.carry_rows(max_k))
        self.max_k = max_k
        self.rollback = rollback  # the one Rollback of every step
        # every step's verify and rollback (model/step.py), eager or CUDA-graphed (same bits, minus the
        # launch cost); a step of one sequence at any K <= max_k replays a bucket of exactly its rows (model/padding.py)
        self.runner = StepRunner(model, self.pool, rollback, cuda_graphs, graph_rows, one_sequence_rows=max_k + 1)
        self.prefill_chunk = prefill_chunk
        self.prefill_forwards = 0  # prefill forwards run (each holds one chunk of one or more prompts)
        self.prefix_cache = PrefixCache(prefill_chunk, prefix_cache_bytes) if prefix_cache_bytes else None

    @property
    def rollback_mode(self) -> str:
        """The rollback's name (ModelInfo.rollback_mode)."""
        return self.rollback.name

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def max_seq_len(self) -> int:
        """Positions a slot holds: a sequence's prompt, its tokens and a step's rows fit in it."""
        return self.pool.max_seq_len

    @property
    def n_slots(self) -> int:
        return self.pool.n_slots

    @property
    def graphed(self) -> bool:
        """Whether steps replay CUDA graphs (else they run eagerly)."""
        return self.runner.graphed

    @property
    def max_graph_rows(self) -> int | None:
        """The largest graph bucket's rows (a step of more runs eagerly); None when not graphed."""
        return self.runner.max_graph_rows

    @on_model_device
    def warm_up(self) -> None:
        """Capture every graph bucket now, before the first step, so
        that serving never captures (nothing to do when eager); and on CUDA compile the kernels that
        choose tokens from a step's logits (outside the graphs), so that the first served step does
        not compile them (a compile inside a served step stalls every session in its batch)."""
        self.runner.capture()
        if self.model.device.type == "cuda":
            logits = torch.zeros(2, self.vocab_size, dtype=torch.float32, device=self.model.device)  # as _logits gives
            argmax_rows(logits)  # greedy rows
            # without masks, then with top-k and top-p (the thresholds' running sum, kernels/sampling.py cumsum_rows)
            for sampled in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=2, top_p=0.9)):
                choose_rows(logits, [sampled] * 2, [1, 2])

    @property
    def graph_captures(self) -> int:
        """Graph buckets (a verify and a rollback graph each) captured since construction (the
        runner's: its max_graph_rows, buckets and the rest are read there, not mirrored here)."""
        return self.runner.captures

    @property
    def cost_buckets(self) -> list[int]:
        """The shared graph buckets' rows, fewest first: the rows step_costs times."""
        return [shape.rows for shape in self.runner.shared]

    def padding_step(self, index: int) -> None:
        """One step of padding rows only through shared bucket `index` (no real slot changes): what
        step_costs times, one bucket at a time (the mirrored engine times them so)."""
        self.runner.padding_step(self.runner.shared[index])

    @on_model_device
    def step_costs(self) -> dict[int, float]:
        """Seconds per step (verify + rollback) by bucket rows, timed now on the scratch slot: every
        bucket through its graphs, or eagerly (the CPU) the smallest buckets within ~0.5 s
        (StepRunner.step_costs). Real slots are not touched."""
        return self.runner.step_costs()

    @on_model_device
    def open(self, prompt: list[int], sampling: SamplingParams, max_new_tokens: int, eos_ids: tuple[int, ...] | None = None,
             want_hidden: bool = False) -> Sequence:
        """Admit a slot, prefill the prompt, choose the first token (it becomes the pending token).
        The caller has checked its arguments: a non-empty prompt of vocabulary ids that leaves room
        for a step, and max_new_tokens >= 1. want_hidden: keep the prompt rows' hidden rows
        (Sequence.prompt_hidden). The open of `opening`, run to its end at once."""
        opening = self._opening(prompt, sampling, max_new_tokens, eos_ids, want_hidden)
        while not opening.advance():
            pass
        return opening.sequence()

    @on_model_device
    def opening(self, prompt: list[int], sampling: SamplingParams, max_new_tokens: int, eos_ids: tuple[int, ...] | None = None,
                want_hidden: bool = False) -> Opening:
        """An open that prefills one chunk per `Opening.advance`, so a caller may run steps of the
        other sequences between its chunks (the server does: a long prompt stalls the running batch
        for a chunk at a time, not for the whole prompt). The slot is admitted now, and the longest
        cached prefix restored (prefix cache); the bits are open's."""
        return self._opening(prompt, sampling, max_new_tokens, eos_ids, want_hidden)

    def _opening(self, prompt: list[int], sampling: SamplingParams, max_new_tokens: int, eos_ids: tuple[int, ...] | None,
                 want_hidden: bool) -> Opening:
        assert prompt and max_new_tokens >= 1, "open needs a prompt and max_new_tokens >= 1"
        assert len(prompt) + 1 <= self.pool.max_seq_len, f"a prompt of {len(prompt)} tokens fills max_seq_len {self.pool.max_seq_len}"
        slot = self.pool.admit()
        try:
            return Opening(self, slot, prompt, sampling, max_new_tokens, eos_ids, want_hidden)
        except BaseException:
            self.pool.release(slot)
            raise

    @on_model_device
    def advance_openings(self, openings: list[Opening | Opened], piece: int | None = None) -> list[bool]:
        """The next chunk of each unfinished opening (of this engine), all in one prefill forward
        where the kernels make every row's bits independent of the rest of its batch (the Triton
        backend: `together`), else one opening a forward -> whether each prompt is all in.
        Each prompt's chunks, bits and cached prefixes are those of its own advances. A forward
        that fails fails every opening in it (their slots released). piece: at most this many of
        each chunk's rows (`step`'s piece)."""
        live = [o for o in openings if isinstance(o, Opening) and o.logits is None]
        limit = self.piece_limit(piece)
        try:
            for part in ([live] if self.together else [[o] for o in live]):
                self._ingest(part, [o.next_chunk(limit) for o in part])
        except BaseException:
            for o in live:
                o.abort()
            raise
        return [o.logits is not None if isinstance(o, Opening) else o.advance() for o in openings]

    def piece_limit(self, piece: int | None) -> int | None:
        """The rows a piece of a chunk may hold (Opening.next_chunk's limit): `piece` rounded down to
        a multiple of PIECE_ALIGN, where the kernels make a prompt row's bits independent of the
        rows beside it in its forward (`together`: a chunk taken in pieces then gives a whole
        chunk's bits) and the chunks are whole multiples of it; else None, whole chunks."""
        if piece is None or not self.together or self.prefill_chunk % PIECE_ALIGN:
            return None
        return max(PIECE_ALIGN, piece // PIECE_ALIGN * PIECE_ALIGN)

    def _ingest(self, live: list[Opening], chunks: list[tuple[int, int]]) -> None:
        """One prefill forward of each opening's rows chunks[i] = [begin, end), then each one's
        ingested (Opening._ingested); a failure aborts them all (their slots released)."""
        try:
            prompts = self._prompt_rows(live, chunks, groups=False)
            (batch,) = prompts.groups
            prompts.logits = self.model.forward(prompts.tokens, batch, self.pool, row_invariant=False, last_only=True,
                                                hidden_out=prompts.hidden)
            self.prefill_forwards += 1
            self._settle(live, chunks, prompts)
        except BaseException:
            for o in live:
                o.abort()
            raise

    def _prompt_rows(self, live: list[Opening], chunks: list[tuple[int, int]], *, groups: bool) -> PromptRows:
        """The rows chunks[i] = [begin, end) of each opening's prompt as PromptRows: one group, or
        (groups, where a prompt's bits depend on the rows beside it: not `together`) one an opening,
        each what its own prefill forward holds; a hidden buffer where an opening keeps hidden rows."""
        if groups and not self.together:
            batches = [RowBatch(slots=(o.slot,), starts=(b,), counts=(e - b,)) for o, (b, e) in zip(live, chunks)]
        else:
            batches = [RowBatch(slots=tuple(o.slot for o in live), starts=tuple(b for b, _ in chunks),
                                counts=tuple(e - b for b, e in chunks))]
        tokens = torch.tensor([t for o, (b, e) in zip(live, chunks) for t in o.prompt[b:e]], dtype=torch.int64)
        rows = sum(e - b for b, e in chunks)
        hidden = self._hidden_buffer(rows) if any(o._rows is not None for o in live) else None
        return PromptRows(tuple(batches), tokens, hidden)

    @staticmethod
    def _settle(live: list[Opening], chunks: list[tuple[int, int]], prompts: PromptRows) -> None:
        """Each opening's rows in (its hidden rows kept, the prefix cache fed: Opening._ingested),
        from the forward's PromptRows: its logits hold each opening's last row, in order."""
        for o, (b, e), first, logits in zip(live, chunks, itertools.accumulate((e - b for b, e in chunks), initial=0),
                                            prompts.logits):
            if o._rows is not None:
                o._rows[b:e].copy_(prompts.hidden[first : first + e - b])
            o._ingested(e, logits)

    @property
    def together(self) -> bool:
        """Whether prompts of several openings share a prefill forward: on the Triton backend every
        kernel computes a row from its own sequence only (the step's row invariance), so a prompt's
        bits do not depend on the prompts beside it. The CPU reference's whole-chunk torch ops make
        no such promise, and a tensor-parallel rank replays whole opens: one prompt a forward (the
        condition steps are graphed under)."""
        return graphs_supported(self.model)

    def _hidden_buffer(self, rows: int) -> torch.Tensor:
        """[rows, H] in the model's dtype on its device: what compute's hidden_out copies into."""
        return torch.empty(rows, self.model.config.hidden_size, dtype=self.model.dtype, device=self.model.device)

    @on_model_device
    def close(self, seq: Sequence) -> None:
        self.pool.release(seq.slot)

    # -- a slot as a context (the model drafter's door: its own rows, no acceptance) --------------

    def admit(self) -> int:
        """A free slot, its recurrent state at zero (PoolFullError when none is free)."""
        return self.pool.admit()

    def release(self, slot: int) -> None:
        self.pool.release(slot)

    @on_model_device
    def prefill(self, slot: int, tokens: list[int]) -> torch.Tensor:
        """Consume `tokens` into `slot` from position 0 (prefill's chunks) -> the last token's logits [vocab]."""
        return self.model.prefill(self.pool, slot, tokens, chunk=self.prefill_chunk)

    @on_model_device
    def consume(self, slot: int, start: int, tokens: list[int]) -> torch.Tensor:
        """Consume `tokens` into `slot` at `start` through the step's path (verify, then a rollback
        keeping every row), with the bits a step gives them -> the last row's logits [vocab] (a copy)."""
        step = self.runner.step(tokens, RowBatch(slots=(slot,), starts=(start,), counts=(len(tokens),)))
        last = step.verify()[-1].clone()  # a graph's next replay overwrites its output
        step.rollback([len(tokens)])
        return last

    def save_recurrent(self, slot: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the slot's conv windows and committed recurrent states, per recurrent layer
        (attention needs none: its rows past a position are overwritten before they are read)."""
        return [(layer.conv[slot].clone(), self.rollback.committed_state(self.pool, layer, slot))
                for layer in self.pool.layers if isinstance(layer, RecurrentState)]

    def restore_recurrent(self, slot: int, saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The slot's conv windows and recurrent states back to `saved` (save_recurrent's), carrying no rows."""
        self.pool.write_recurrent(slot, saved)

    def slot_tensors(self, slot: int, position: int) -> list[list[torch.Tensor]]:
        """Per layer, copies of every state tensor that defines `slot` at committed `position`: KV
        rows [0, position), or the conv window and the recurrent state (its carried rows applied)."""
        return [[layer.keys[slot, :position].clone(), layer.values[slot, :position].clone()] if isinstance(layer, AttentionState)
                else [layer.conv[slot].clone(), self.rollback.committed_state(self.pool, layer, slot)]
                for layer in self.pool.layers]

    # -- steps at fixed addresses, chained in one CUDA graph (the model drafter's draft chain) ----

    @property
    def scratch_slot(self) -> int:
        """The slot no sequence owns: warm-up runs and captures step it and keep no row."""
        return self.pool.scratch_slot

    def fixed_step(self, slot: int, rows: int) -> FixedStep:
        """Steps of `rows` rows into `slot` whose inputs sit at fixed device addresses, with this
        engine's forward and rollback, so their bits are its steps' (model/step.py FixedStep)."""
        return FixedStep(self.model, self.pool, slot, rows, self.rollback)

    def step_graph(self, steps: int, memory) -> StepGraph:
        """A CUDA graph of up to `steps` fixed steps, captured into graph memory pool `memory`."""
        return StepGraph(self.pool, steps, memory, self.model.device)

    def recurrent_states(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per recurrent layer, the pool's conv windows [slots, conv_dim, W-1] and recurrent states
        [slots, heads, d_k, d_v] themselves (not copies): a graph saves a slot's rows from them and
        restores them in place, as fixed addresses it can replay."""
        return [(layer.conv, layer.recurrent) for layer in self.pool.layers if isinstance(layer, RecurrentState)]

    def check(self, request: StepRequest) -> None:
        """StepError if the sequence's state cannot take this step; never touches state."""
        seq, drafts = request.sequence, request.drafts
        assert len(drafts) <= self.max_k, f"{len(drafts)} drafts exceed max_k {self.max_k}"
        assert request.draft_probs is None or tuple(request.draft_probs.shape) == (len(drafts), self.vocab_size), \
            f"draft_probs has shape {list(request.draft_probs.shape)}, expected [{len(drafts)}, {self.vocab_size}]"
        if seq.finished:
            raise StepError("failed_precondition", f"the sequence has finished ({seq.finish_reason})")
        if seq.lost:
            raise StepError("failed_precondition", "an engine step failed midway with this sequence in it, so its state "
                                                   "is no longer known to match its position: open a new sequence")
        if seq.position + len(drafts) + 1 > self.pool.max_seq_len:
            raise StepError("out_of_range", f"{len(drafts) + 1} rows from position {seq.position} pass max_seq_len {self.pool.max_seq_len}")

    @on_model_device
    def step(self, requests: list[StepRequest], openings: Seq[Opening | Opened] = (), piece: int | None = None) -> list[StepResult]:
        """One engine step over many sequences; a request its sequence's state refuses gets its
        StepError, the others run.
        openings: opens whose prompts go on in this step (DESIGN.md section 9, "Prompts inside a
        step"): the next chunk of each unfinished one (at most `piece` of its rows: piece_limit)
        runs in the step's forward, committed, with the bits its own prefill forward gives it; with
        no request to run they take one prefill forward (advance_openings). Whether a prompt is all
        in: its `logits`. A failure fails them (their slots released) and the step's sequences."""
        results: list[StepResult | None] = [None] * len(requests)
        live: list[int] = []
        slots: set[int] = set()
        for i, req in enumerate(requests):
            try:
                self.check(req)
                if req.sequence.slot in slots:
                    raise StepError("invalid_argument", "the same sequence appears twice in one step")
                slots.add(req.sequence.slot)
                live.append(i)
            except StepError as err:
                logits = torch.empty(0, self.vocab_size) if req.want_logits else None
                results[i] = StepResult(0, [], req.sequence.position, req.sequence.finish_reason, logits, err)
        if live:
            for i, result in zip(live, self._run([requests[i] for i in live], openings, piece)):
                results[i] = result
        elif openings:
            self.advance_openings(list(openings), piece)
        return results

    def _run(self, requests: list[StepRequest], openings: Seq[Opening | Opened], piece: int | None) -> list[StepResult]:
        opening = [o for o in openings if isinstance(o, Opening) and o.logits is None]
        if not opening:
            return self._verify(requests, None)
        limit = self.piece_limit(piece)
        chunks = [o.next_chunk(limit) for o in opening]
        try:
            prompts = self._prompt_rows(opening, chunks, groups=True)
            results = self._verify(requests, prompts)
            self._settle(opening, chunks, prompts)
        except BaseException:
            for o in opening:
                o.abort()
            raise
        return results

    def _verify(self, requests: list[StepRequest], prompts: PromptRows | None) -> list[StepResult]:
        sequences = [r.sequence for r in requests]
        batch = RowBatch(
            slots=tuple(seq.slot for seq in sequences),
            starts=tuple(seq.position for seq in sequences),
            counts=tuple(len(r.drafts) + 1 for r in requests),
        )
        # a list, not a tensor: checked with builtins and written into the step's pinned inputs as it is
        # (a batch-1 step's host time is on its critical path: the GPU waits for it)
        tokens = [t for r in requests for t in (r.sequence.pending, *r.drafts)]
        step = self.runner.step(tokens, batch, prompts)  # rows checked (a caller bug: asserted) before any state changes
        try:
            return self._verify_accept_rollback(requests, sequences, step)
        except BaseException:
            # the verify may have committed one-row sequences' rows and slots' carried rows, and the
            # rollback may not have run:
            # no sequence of the step is known to be consistent (a bug or a device fault, not bad input)
            for seq in sequences:
                seq.lost = True
            raise

    def _verify_accept_rollback(self, requests: list[StepRequest], sequences: list[Sequence], step: Step) -> list[StepResult]:
        # a step whose requests want hidden rows gets every row's (Step.verify copies them, graphed or eager)
        hidden = self._hidden_buffer(step.batch.n_rows) if any(r.want_hidden for r in requests) else None
        logits, batch = step.verify(hidden), step.batch
        early = self._copy_early(logits, batch, requests)  # queued behind the verify, before its ids are waited for
        verdicts = accept(logits, batch, [r.drafts for r in requests], [seq.sampling for seq in sequences],
                          [r.draft_probs for r in requests], step.greedy_ids)
        # per sequence after the ids reach the host, the GPU idle until the rollback: few operations
        # each (64 sequences' results, rows' copy and checks; bench.gpu's step_timeline shows the gap)
        results, consumed, wanted = [], [], []
        for req, seq, first, (accepted, bonus) in zip(requests, sequences, batch.offsets, verdicts):
            emitted = req.drafts[:accepted]
            emitted.append(bonus)
            emitted, finish = self._cut(seq, emitted)
            n = len(emitted)
            # Each emitted token's row is consumed: the pending token plus the accepted drafts kept.
            consumed.append(n)
            seq.position = position = seq.position + n  # the batch's start for this sequence, moved on
            seq.pending = emitted[-1]
            seq.emitted += n
            seq.finish_reason = finish
            result = StepResult(accepted, emitted, position, finish, None)
            if req.want_hidden:
                result.hidden = hidden[first : first + n]  # a view of this step's own buffer
            results.append(result)
            if req.want_logits:
                wanted.append((result, first, n))
        self._keep_rows(logits, wanted, early)
        step.rollback(consumed)
        return results

    @staticmethod
    def _copy_early(logits: torch.Tensor, batch: RowBatch, requests: list[StepRequest]) -> tuple[int, torch.Tensor] | None:
        """(first row, a copy of logits rows first .. last) spanning every row of the sequences that
        want their logits, queued right after the verify while the GPU still runs it, when that span
        is at most EARLY_LOGITS_BYTES; else None (the emitted rows are copied after acceptance).
        Copied after acceptance, the rows cost a step's critical path the copy's launch and run with
        the GPU idle (at batch 1 the early copy shortens the GPU's idle gap between steps; at batch 64
        the change is within the noise); copied here, a decode's rows are exactly
        its emitted ones, and a small verify copies its K + 1 rows of which the results keep views."""
        wanting = [s for s, req in enumerate(requests) if req.want_logits]
        if not wanting:
            return None
        offsets = batch.offsets
        first, end = offsets[wanting[0]], offsets[wanting[-1] + 1]
        if (end - first) * logits.shape[1] * logits.element_size() > EARLY_LOGITS_BYTES:
            return None
        return first, logits[first:end].clone()

    @staticmethod
    def _keep_rows(logits: torch.Tensor, wanted: list[tuple[StepResult, int, int]],
                   early: tuple[int, torch.Tensor] | None = None) -> None:
        """Each (result, its first row in logits, its emitted rows) gets those rows, since a graph's
        next replay overwrites the logits: views of one copy, `early` (_copy_early's, made before
        the acceptance) where there is one, else one made now of the emitted rows alone. Only the
        emitted rows: at 64 sequences x 9 rows the 2B model's verify holds 350 MB of fp32 logits, of
        which a step whose drafts are all rejected returns a ninth. One copy and one split, not a
        slice per sequence: every tensor slice is host work of its own, and slices per sequence (two
        each) run after the rows reach the host, with the GPU idle, so they grow the step's critical
        path with the batch (`python -m bench.gpu`'s step_timeline splits a step into GPU-busy time
        and host). One mechanism either way: the copy
        is made early when it is small, late when only the emitted rows are affordable."""
        if not wanted:
            return
        counts = [n for _, _, n in wanted]
        one_range = _one_range(wanted, counts)
        first, total = wanted[0][1], sum(counts)
        if early is not None:
            start, rows = early
            if one_range and first == start and total == rows.shape[0]:  # the copy is the emitted rows (a decode)
                _hand_out(rows, wanted, counts)
            else:
                for result, row, n in wanted:
                    result.logits = rows[row - start : row - start + n]
            return
        if one_range:
            kept = logits[first : first + total].clone()  # one range: every sequence's rows follow the last's (a decode)
        else:
            index = [start + r for _, start, n in wanted for r in range(n)]
            kept = logits.index_select(0, torch.tensor(index, dtype=torch.int64).to(logits.device))
        _hand_out(kept, wanted, counts)

    @staticmethod
    def _cut(seq: Sequence, emitted: list[int]) -> tuple[list[int], str | None]:
        """Cut at the first eos (kept) and at the token budget."""
        if seq.emitted + len(emitted) < seq.max_new_tokens and seq.eos_ids.isdisjoint(emitted):
            return emitted, None  # no eos and room past these tokens: nothing to cut (most steps)
        for i, token in enumerate(emitted):
            if token in seq.eos_ids:
                emitted = emitted[: i + 1]
                break
        room = seq.max_new_tokens - seq.emitted
        emitted = emitted[:room]
        if emitted[-1] in seq.eos_ids:
            return emitted, EOS
        if seq.emitted + len(emitted) >= seq.max_new_tokens:
            return emitted, LENGTH
        return emitted, None


class Opening:
    """An open in progress (Engine.opening): its slot admitted, the prompt prefilled a chunk per
    `advance`, the first token chosen by `sequence`. A failure releases the slot."""

    def __init__(self, engine: Engine, slot: int, prompt: list[int], sampling: SamplingParams, max_new_tokens: int,
                 eos_ids: tuple[int, ...] | None, want_hidden: bool):
        self.engine, self.slot, self.prompt = engine, slot, prompt
        self.sampling, self.max_new_tokens, self.eos_ids = sampling, max_new_tokens, eos_ids
        self.hidden = engine._hidden_buffer(len(prompt)) if want_hidden else None  # the sequence's prompt_hidden
        cache = engine.prefix_cache
        # with a prefix cache that keeps hidden rows, every open computes them (the chunks keep them)
        self._rows = self.hidden if self.hidden is not None or cache is None or not cache.keep_hidden \
            else engine._hidden_buffer(len(prompt))
        self._path = cache.longest(prompt, want_hidden=self._rows is not None) if cache is not None else []
        self.position = cache.restore(engine.pool, slot, self._path, self._rows) if self._path else 0
        self.logits: torch.Tensor | None = None  # the last token's, once the prompt is in

    def advance(self) -> bool:
        """Prefill the rest of the chunk it is in (keeping the chunk in the prefix cache when it is
        whole) -> whether the prompt is all in."""
        if self.logits is None:
            with device_scope(self.engine.model.device):
                self.engine._ingest([self], [self.next_chunk()])
        return self.logits is not None

    def next_chunk(self, limit: int | None = None) -> tuple[int, int]:
        """The prompt positions [begin, end) it prefills next: to the end of the chunk it is in
        (chunks start at multiples of the engine's prefill_chunk from position 0), or at most
        `limit` rows of it (a piece: Engine.piece_limit)."""
        begin, chunk = self.position, self.engine.prefill_chunk
        end = min((begin // chunk + 1) * chunk, len(self.prompt))
        return begin, end if limit is None else min(end, begin + limit)

    def _ingested(self, end: int, logits: torch.Tensor) -> None:
        """The slot holds the prompt up to `end` (logits [vocab]: its last row's): a chunk now whole
        goes to the prefix cache; the last one leaves the logits the first token is chosen from."""
        cache = self.engine.prefix_cache
        if cache is not None and end % self.engine.prefill_chunk == 0:
            self._path = cache.store(self.engine.pool, self.slot, self.prompt, self._path, end, self._rows)
        self.position = end
        if end == len(self.prompt):
            self.logits = logits
            if cache is not None:
                cache.trim()

    def sequence(self) -> Sequence:
        """The opened sequence: its first token chosen from the last prompt row's logits."""
        assert self.logits is not None, "an opening's sequence comes after its last chunk"
        logits, seq_len = self.logits, len(self.prompt)
        token = choose(logits, self.sampling, seq_len)
        eos = frozenset(self.engine.model.config.eos_token_ids if self.eos_ids is None else self.eos_ids)
        seq = Sequence(self.slot, seq_len, token, self.sampling, self.max_new_tokens, eos, first_logits=logits,
                       prompt_hidden=self.hidden)
        if token in eos:
            seq.finish_reason = EOS
        elif self.max_new_tokens == 1:
            seq.finish_reason = LENGTH
        return seq

    def abort(self) -> None:
        """Give the slot back (an open that failed, or that its caller gives up)."""
        if self.slot is not None:
            self.engine.pool.release(self.slot)
            self.slot = None
            if self.engine.prefix_cache is not None:
                self.engine.prefix_cache.trim()


class Opened:
    """An opening already done (the whole open ran at once): what an engine that cannot stop
    between chunks gives (a tensor-parallel server's: its followers replay whole opens)."""

    def __init__(self, engine: Engine, seq: Sequence, prompt: list[int]):
        self.engine, self.seq, self.prompt = engine, seq, prompt

    def advance(self) -> bool:
        return True

    def sequence(self) -> Sequence:
        return self.seq

    def abort(self) -> None:
        """Close the sequence (its caller gives the open up)."""
        if self.seq is not None:
            self.engine.close(self.seq)
            self.seq = None
