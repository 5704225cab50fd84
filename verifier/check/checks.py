"""The six checks of `python -m verifier check`, each a function of (model, settings, progress)
returning its CheckResult. Every comparison is bitwise (results.py); each check keeps going past a
difference in one stream so the counts say how much differs, and stops that stream (its later rows
would follow another path).
The design in full: DESIGN.md section 5, "The checks of verifier check".
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..engine import PIECE_ALIGN, Engine, StepRequest
from ..generate import generate
from ..model.hybrid import PREFILL_CHUNK
from ..model.rollback import ROLLBACK_MODES, WOA
from ..params import SamplingParams
from ..proposers import NgramProposer, OracleProposer, RandomProposer
from .layers import LayerOutputs
from .reference import serial_run, slot_state
from .results import CheckResult

DRAFT_KINDS = ("wrong", "right", "random")  # wrong: never the serial token; right: the serial continuation
PROMPT_SPREAD = 8  # the full batch's prompts are prompt_len + (i % PROMPT_SPREAD) long: its sequences sit at different positions


@dataclass(frozen=True)
class CheckSettings:
    max_k: int  # K runs 1..max_k
    prompt_len: int  # prompt tokens per sequence (random ids, seeded)
    new_tokens: int  # tokens each stream emits, the first one included
    sequences: int  # sequences sharing the full-batch steps
    seed: int  # prompts, random drafts and the seeded sampling

    def __post_init__(self):
        for name, low in (("max_k", 1), ("prompt_len", 1), ("new_tokens", 2), ("sequences", 2), ("seed", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be at least {low}, got {getattr(self, name)}")

    @property
    def max_seq_len(self) -> int:
        """Room for the longest prompt (the full batch lengthens some), the stream and a full verify."""
        return self.prompt_len + PROMPT_SPREAD - 1 + self.new_tokens + self.max_k + 1


def make_prompt(vocab: int, length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    low = 3 if vocab > 3 else 0  # ids 0..2 are often pad / bos / eos
    return torch.randint(low, vocab, (length,), generator=gen).tolist()


def _engine(model, settings: CheckSettings, n_slots: int = 1, mode: str = WOA, cuda_graphs: bool = True) -> Engine:
    return Engine(model, n_slots, settings.max_seq_len, settings.max_k, mode, cuda_graphs=cuda_graphs)


def _step(engine: Engine, requests: list[StepRequest], openings=(), piece: int | None = None):
    """engine.step, raising a request's StepError: the check sized the engine for every step it
    sends, so one is a bug of the check, not a difference of bits."""
    results = engine.step(requests, openings, piece)
    for res in results:
        if res.error is not None:
            raise res.error
    return results


def _result(model, name: str, title: str, path: str) -> CheckResult:
    """A check's empty result; its comparisons agreed across the model's ranks, if it has any."""
    return CheckResult(name, title, path, parallel=getattr(model, "parallel", None))


def _path(engine: Engine) -> str:
    return "cuda graphs" if engine.graphed else "eager"


def _cached_and_plain(model, settings: CheckSettings, slots: int, room: int, mode: str) -> tuple[Engine, Engine]:
    """Two engines alike but for a prefix cache (the first has one, unbounded)."""
    return (Engine(model, slots, room, settings.max_k, mode, prefix_cache_bytes=1 << 40),
            Engine(model, slots, room, settings.max_k, mode))


def _compare_opens(result: CheckResult, engine: Engine, seq, ref_engine: Engine, ref, where: str) -> None:
    """Two opens of one prompt (seq on engine, ref on ref_engine): the first row and token, then
    every layer's state after the open."""
    result.compare_rows([seq.pending], seq.first_logits[None], [ref.pending], ref.first_logits[None], lambda r: f"{where}: first row")
    result.compare_states(slot_state(engine, seq.slot, seq.position), slot_state(ref_engine, ref.slot, ref.position),
                          f"{where}: state after the open")


def _drafts(kind: str, truth: list[int], k: int, vocab: int, gen: torch.Generator) -> list[int]:
    """k drafts against the serial continuation `truth` (at least k long)."""
    if kind == "right":
        return truth[:k]
    if kind == "wrong":
        return [(t + 1 + int(torch.randint(0, vocab - 1, (1,), generator=gen))) % vocab for t in truth[:k]]
    return torch.randint(0, vocab, (k,), generator=gen).tolist()


def verify_vs_serial(model, settings: CheckSettings, progress) -> CheckResult:
    vocab = model.config.vocab_size
    engine = _engine(model, settings, cuda_graphs=False)  # eager, so the layer recorder sees every row
    result = _result(model, "verify_vs_serial", f"verify rows == serial decode rows (K = 1..{settings.max_k}; "
                     "wrong, right and random drafts; every layer's output row)", _path(engine))
    prompt = make_prompt(vocab, settings.prompt_len, settings.seed)
    gen = torch.Generator().manual_seed(settings.seed + 1)
    with LayerOutputs(model) as recorder:
        # the truth runs max_k past the stream, so right drafts near its end are still right
        serial = serial_run(engine, prompt, settings.new_tokens + settings.max_k, recorder=recorder)
        for k in range(1, settings.max_k + 1):
            progress(f"verify_vs_serial: K={k}")
            for kind in DRAFT_KINDS:
                _verify_stream(engine, serial, recorder, result, settings.new_tokens, k, kind, vocab, gen)
    return result


def _verify_stream(engine, serial, recorder, result, n_tokens, k, kind, vocab, gen) -> None:
    seq = engine.open(serial.prompt, SamplingParams(), n_tokens, eos_ids=())
    recorder.take()  # prefill's rows
    try:
        step = 0
        while not seq.finished:
            done = seq.emitted  # stream rows emitted so far: this step's row r is stream row done + r
            (res,) = _step(engine, [StepRequest(seq, _drafts(kind, serial.tokens[done:], k, vocab, gen))])
            layer_rows = recorder.take()
            n = len(res.tokens)
            where = lambda r: f"K={k} {kind} drafts, step {step}, row {r} (stream row {done + r})"  # noqa: E731
            equal = True
            for r in range(n):  # layers first: the first difference names the first layer that differs
                equal &= result.compare_layer_rows(recorder.kinds, [part[r] for part in layer_rows], serial.layer_rows[done + r], where(r))
            equal &= result.compare_rows(res.tokens, res.logits, serial.tokens[done : done + n], serial.logits[done : done + n], where)
            if not equal:
                return
            step += 1
    finally:
        engine.close(seq)


def rollback_state(model, settings: CheckSettings, progress) -> CheckResult:
    vocab, p = model.config.vocab_size, settings.prompt_len
    prompt = make_prompt(vocab, p, settings.seed + 2)
    n_tokens = settings.max_k + 3  # the truth covers K drafts, the bonus and one decode row after
    accepted_at = {k: k // 2 for k in range(1, settings.max_k + 1)}  # a partial accept: 0 at K = 1
    keep = frozenset(q for a in accepted_at.values() for q in (p + a + 1, p + a + 2))
    serial = serial_run(_engine(model, settings), prompt, n_tokens, keep_states=keep)
    gen = torch.Generator().manual_seed(settings.seed + 3)
    engines = {mode: _engine(model, settings, mode=mode) for mode in ROLLBACK_MODES}
    result = _result(model, "rollback_state", "state after a partial accept and rollback == serial decode's, and the next "
                     f"decode row ({', '.join(ROLLBACK_MODES)})", _path(engines[WOA]))
    for mode, engine in engines.items():
        progress(f"rollback_state: {mode}")
        for k, a in accepted_at.items():
            where = f"{mode} K={k} accepting {a}"
            seq = engine.open(prompt, SamplingParams(), n_tokens, eos_ids=())
            try:
                truth = serial.tokens[1:]
                drafts = truth[:a] + _drafts("wrong", truth[a:], 1, vocab, gen) + _drafts("random", [], k - a - 1, vocab, gen)
                for drafts_now in (drafts, []):  # the verify with its rollback, then one decode step
                    done = seq.emitted
                    (res,) = _step(engine, [StepRequest(seq, drafts_now)])
                    n = len(res.tokens)
                    rows_equal = result.compare_rows(res.tokens, res.logits, serial.tokens[done : done + n],
                                                     serial.logits[done : done + n], lambda r: f"{where}: stream row {done + r}")
                    if not rows_equal or seq.position not in serial.states:
                        break
                    result.compare_states(slot_state(engine, seq.slot, seq.position), serial.states[seq.position],
                                          f"{where}: state at position {seq.position}")
            finally:
                engine.close(seq)
    return result


def _full_batch_plan(sequence: int, step: int, max_k: int) -> tuple[int, int]:
    """(K, right drafts) of a sequence in a step of the full batch: step 0 decodes every sequence,
    step 1 verifies max_k drafts for every one (the largest batch), later steps mix K (0 included)
    across the sequences; right drafts vary so that accepted counts and rollbacks differ."""
    if step == 0:
        return 0, 0
    k = max_k if step == 1 else (3 * sequence + 5 * step) % (max_k + 1)
    return k, (sequence + step) % (k + 1)


def full_batch_vs_alone(model, settings: CheckSettings, progress) -> CheckResult:
    vocab, n = model.config.vocab_size, settings.sequences
    prompts = [make_prompt(vocab, settings.prompt_len + i % PROMPT_SPREAD, settings.seed + 10 + i) for i in range(n)]
    serial_engine = _engine(model, settings)
    progress(f"full_batch_vs_alone: the serial truth of {n} prompts")
    truths = [serial_run(serial_engine, prompt, settings.new_tokens + settings.max_k).tokens for prompt in prompts]
    del serial_engine
    together, alone = _engine(model, settings, n), _engine(model, settings, n)
    result = _result(model, "full_batch_vs_alone",
                     f"{n} sequences stepped in one batch (decodes, K = {settings.max_k} verifies, mixed K) "
                     "== each sequence's step alone (rows and every layer's state)", _path(together))
    gen = torch.Generator().manual_seed(settings.seed + 4)
    seqs_t = [together.open(p, SamplingParams(), settings.new_tokens, eos_ids=()) for p in prompts]
    seqs_a = [alone.open(p, SamplingParams(), settings.new_tokens, eos_ids=()) for p in prompts]
    live, step = set(range(n)), 0
    while live:
        owners = sorted(i for i in live if not seqs_t[i].finished and not seqs_a[i].finished)
        if not owners:
            break
        drafts = {}
        for i in owners:
            k, right = _full_batch_plan(i, step, settings.max_k)
            truth = truths[i][seqs_t[i].emitted:]
            drafts[i] = truth[:right] + _drafts("wrong", truth[right:], min(1, k - right), vocab, gen) \
                + _drafts("random", [], max(0, k - right - 1), vocab, gen)
        rows = sum(len(d) + 1 for d in drafts.values())
        progress(f"full_batch_vs_alone: step {step}, {len(owners)} sequences, {rows} rows")
        result.batch_rows.append(rows)
        results_t = _step(together, [StepRequest(seqs_t[i], drafts[i]) for i in owners])
        results_a = [_step(alone, [StepRequest(seqs_a[i], drafts[i])])[0] for i in owners]
        for i, got, want in zip(owners, results_t, results_a):
            where = f"step {step} of {rows} rows, sequence {i} (K={len(drafts[i])})"
            equal = result.compare_rows(got.tokens, got.logits, want.tokens, want.logits, lambda r: f"{where}, row {r}")
            if equal and seqs_t[i].position == seqs_a[i].position:
                equal = result.compare_states(slot_state(together, seqs_t[i].slot, seqs_t[i].position),
                                              slot_state(alone, seqs_a[i].slot, seqs_a[i].position), where)
            if not equal:
                live.discard(i)  # its later steps would follow another path
        live -= {i for i in owners if seqs_t[i].finished}
        step += 1
    return result


def streams_vs_plain(model, settings: CheckSettings, progress) -> CheckResult:
    vocab = model.config.vocab_size
    engine = _engine(model, settings)
    result = _result(model, "streams_vs_plain", "speculative streams == plain decoding (oracle, n-gram and random "
                     "drafters; greedy and seeded sampling)", _path(engine))
    half = make_prompt(vocab, (settings.prompt_len + 1) // 2, settings.seed + 5)
    prompt = (half * 2)[: settings.prompt_len]  # a repeat gives the n-gram drafter something to find
    ks = sorted({min(2, settings.max_k), settings.max_k})
    samplings = {"greedy": SamplingParams(),
                 "seeded (temperature 0.9, top-k 8, top-p 0.9)": SamplingParams(temperature=0.9, top_k=8, top_p=0.9, seed=settings.seed)}
    for label, sampling in samplings.items():
        progress(f"streams_vs_plain: {label}")
        plain = generate(engine, prompt, settings.new_tokens, sampling, eos_ids=())
        drafters = {"oracle": OracleProposer(len(prompt), plain.tokens), "n-gram": NgramProposer(),
                    "random": RandomProposer(vocab, settings.seed)}
        for name, proposer in drafters.items():
            for k in ks:
                spec = generate(engine, prompt, settings.new_tokens, sampling, proposer, k, eos_ids=())
                result.compare_rows(spec.tokens, spec.logits, plain.tokens, plain.logits,
                                    lambda r: f"{label}, {name} drafts K={k}: stream row {r}")
    return result


def prefix_cache_vs_cold(model, settings: CheckSettings, progress) -> CheckResult:
    """Prompts sharing a prefix of two whole prefill chunks: opened after the first ingested it, each
    restores it from the prefix cache, and its first row, its slot's state and its stream (n-gram
    drafts at max_k) equal a cold start's, in both rollback modes."""
    vocab, c = model.config.vocab_size, PREFILL_CHUNK
    shared = make_prompt(vocab, 2 * c + 3, settings.seed + 7)
    prompts = [shared + make_prompt(vocab, 5 + i, settings.seed + 8 + i) for i in range(3)]
    room = max(map(len, prompts)) + settings.new_tokens + settings.max_k + 1
    result = None
    for mode in ROLLBACK_MODES:
        cached, cold = _cached_and_plain(model, settings, 1, room, mode)
        if result is None:
            result = _result(model, "prefix_cache_vs_cold", f"a start from cached prefixes ({2 * c} of ~{len(prompts[0])} "
                             f"prompt tokens) == a cold start: first row, slot state, stream ({', '.join(ROLLBACK_MODES)})",
                             _path(cached))
        progress(f"prefix_cache_vs_cold: {mode}")
        for i, prompt in enumerate(prompts):
            where = f"{mode} prompt {i} ({'cold: it fills the cache' if i == 0 else 'cached'})"
            warm, plain = (engine.open(prompt, SamplingParams(), settings.new_tokens, eos_ids=()) for engine in (cached, cold))
            _compare_opens(result, cached, warm, cold, plain, where)
            cached.close(warm)
            cold.close(plain)
            warm = generate(cached, prompt, settings.new_tokens, None, NgramProposer(), settings.max_k, eos_ids=())
            plain = generate(cold, prompt, settings.new_tokens, None, NgramProposer(), settings.max_k, eos_ids=())
            result.compare_rows(warm.tokens, warm.logits, plain.tokens, plain.logits, lambda r: f"{where}: stream row {r}")
        if cached.prefix_cache.stats.hits < 2 * len(prompts) - 1:
            raise RuntimeError(f"prefix_cache_vs_cold: {cached.prefix_cache.stats.hits} cache hits in {mode} mode; the check "
                               "compared cold starts only")
    return result


def prompts_in_steps(model, settings: CheckSettings, progress) -> CheckResult:
    """Prompts taken into the running sequences' steps (Engine.step's openings, in pieces of
    PIECE_ALIGN rows where the backend allows: Engine.piece_limit) == the same steps without them
    and each prompt's open alone: every step's rows and the running slots' state, each prompt's
    first row and its slot's state, and a later open restoring a chunk those pieces cached, in
    both rollback modes."""
    vocab, c = model.config.vocab_size, PREFILL_CHUNK
    running = [make_prompt(vocab, settings.prompt_len + i, settings.seed + 20 + i) for i in range(2)]
    prompts = [make_prompt(vocab, c + c // 2 + 3, settings.seed + 22), make_prompt(vocab, c // 2 + 1, settings.seed + 23)]
    tail = prompts[0][:c] + make_prompt(vocab, 4, settings.seed + 24)  # its first chunk, cached by the pieces
    steps = 2 * -(-c // PIECE_ALIGN)  # the longest prompt's pieces, at the most
    room = max(map(len, prompts)) + steps * (settings.max_k + 1) + settings.new_tokens + 1
    result = None
    for mode in ROLLBACK_MODES:
        mixed, alone = _cached_and_plain(model, settings, 4, room, mode)
        if result is None:
            result = _result(model, "prompts_in_steps", f"{len(prompts)} prompts taken into the steps of {len(running)} running "
                             "sequences == the steps without them and each open alone: rows, states, a cached chunk "
                             f"({', '.join(ROLLBACK_MODES)})", "eager (a step with prompts), " + _path(alone) + " alone")
        progress(f"prompts_in_steps: {mode}")
        gen = torch.Generator().manual_seed(settings.seed + 25)
        budget = steps * (settings.max_k + 1) + 1
        pairs = [(mixed.open(p, SamplingParams(), budget, eos_ids=()), alone.open(p, SamplingParams(), budget, eos_ids=()))
                 for p in running]
        openings = [mixed.opening(p, SamplingParams(), 2, eos_ids=()) for p in prompts]
        step = 0
        while any(o.logits is None for o in openings) and not any(m.finished for m, _ in pairs):
            drafts = [_drafts("random", [], int(torch.randint(0, settings.max_k + 1, (1,), generator=gen)), vocab, gen)
                      for _ in pairs]
            got = _step(mixed, [StepRequest(m, d) for (m, _), d in zip(pairs, drafts)], openings, PIECE_ALIGN)
            want = _step(alone, [StepRequest(a, d) for (_, a), d in zip(pairs, drafts)])
            for i, ((m, a), g, w) in enumerate(zip(pairs, got, want)):
                where = f"{mode} step {step}, running sequence {i} (K={len(drafts[i])})"
                if result.compare_rows(g.tokens, g.logits, w.tokens, w.logits, lambda r: f"{where}, row {r}"):
                    result.compare_states(slot_state(mixed, m.slot, m.position), slot_state(alone, a.slot, a.position), where)
            step += 1
        if any(o.logits is None for o in openings):
            raise RuntimeError(f"prompts_in_steps: the prompts were not all in after {step} steps in {mode} mode")
        for i, (opening, prompt) in enumerate(zip(openings, prompts)):
            seq, ref = opening.sequence(), alone.open(prompt, SamplingParams(), 2, eos_ids=())
            _compare_opens(result, mixed, seq, alone, ref, f"{mode} prompt {i} ({len(prompt)} tokens) taken in over {step} steps")
            mixed.close(seq)
            alone.close(ref)
        hits = mixed.prefix_cache.stats.hits
        warm, cold = mixed.open(tail, SamplingParams(), 2, eos_ids=()), alone.open(tail, SamplingParams(), 2, eos_ids=())
        if mixed.prefix_cache.stats.hits == hits:
            raise RuntimeError(f"prompts_in_steps: no cache hit for the chunk the steps took in ({mode} mode)")
        result.compare_rows([warm.pending], warm.first_logits[None], [cold.pending], cold.first_logits[None],
                            lambda r: f"{mode} a prompt restoring the chunk the steps cached: first row")
    return result


CHECKS = (verify_vs_serial, rollback_state, full_batch_vs_alone, streams_vs_plain, prefix_cache_vs_cold, prompts_in_steps)


def run_checks(model, settings: CheckSettings, progress=lambda message: None) -> list[CheckResult]:
    results = []
    for check in CHECKS:
        start = time.perf_counter()
        results.append(check(model, settings, progress))
        results[-1].seconds = time.perf_counter() - start
    return results
