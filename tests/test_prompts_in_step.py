"""Prompts inside a step (Engine.step's openings): a step's verify and the prompt chunks of opens
in progress share one forward, and every bit is what each would have alone. The running
sequences' results (tokens, logits, hidden rows) equal those of the same steps without prompts,
and each prompt's first logits, hidden rows, slot state and cached prefixes equal those of its
open alone, torch.equal: three families, both rollback modes. On the Triton backend
(--model-device cuda) a step takes each prompt's chunk in pieces of PIECE_ALIGN rows, so these
tests also hold a chunk taken in pieces to a whole chunk's bits."""

import random

import pytest
import torch

from verifier.engine import PIECE_ALIGN, Engine, Opening, StepRequest
from verifier.params import SamplingParams

CHUNK = 2 * PIECE_ALIGN  # a chunk is two pieces on the Triton backend (the CPU reference takes whole chunks)
RUNNING = [[3, 8, 1, 9, 4], [12, 6, 2]]
PROMPTS = [[(7 * i + 3) % 17 + 1 for i in range(CHUNK + CHUNK // 2 + 5)], [(5 * i + 2) % 13 + 1 for i in range(CHUNK // 2 + 1)]]
SEQ_LEN = 4 * CHUNK


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _drafts(rng: random.Random, k: int) -> list[int]:
    return [rng.randrange(1, 18) for _ in range(rng.randrange(0, k + 1))]


def _run(engine: Engine, prompts: list[list[int]], *, inside: bool, steps: int, seed: int, piece: int | None):
    """The running sequences' `steps` steps (seeded random drafts); the prompts open at the first
    step, inside the steps (inside) or alone first -> (per step the results, the opened sequences)."""
    rng = random.Random(seed)
    running = [engine.open(p, SamplingParams(), 64, want_hidden=True) for p in RUNNING]
    if inside:
        openings = [engine.opening(p, SamplingParams(), 4, want_hidden=True) for p in prompts]
    else:
        opened = [engine.open(p, SamplingParams(), 4, want_hidden=True) for p in prompts]
    history = []
    for _ in range(steps):
        requests = [StepRequest(seq, _drafts(rng, engine.max_k), want_hidden=True) for seq in running]
        if inside:
            results = engine.step(requests, [o for o in openings if isinstance(o, Opening) and o.logits is None], piece)
        else:
            results = engine.step(requests)
        history.append([(r.accepted, r.tokens, r.position, r.logits, r.hidden) for r in results])
    if inside:
        assert all(o.logits is not None for o in openings), "the steps took every prompt in"
        opened = [o.sequence() for o in openings]
    return history, opened


@pytest.mark.parametrize("rollback", ["woa", "snapshot"])
@pytest.mark.parametrize("name", ["qwen3_5_text", "kimi_linear", "qwen3_next_moe"])
def test_prompts_inside_steps_equal_steps_and_opens_alone(load_target, name, rollback):
    model = load_target(name)
    mixed = Engine(model, 4, SEQ_LEN, max_k=3, rollback_mode=rollback, cuda_graphs=False, prefill_chunk=CHUNK,
                   prefix_cache_bytes=1 << 30)
    mixed.prefix_cache.keep_hidden = True  # as a server with an MTP head keeps them
    alone = Engine(model, 4, SEQ_LEN, max_k=3, rollback_mode=rollback, cuda_graphs=False, prefill_chunk=CHUNK)
    steps = 5  # the longest prompt's chunks, in pieces, fit in them
    ours, opened = _run(mixed, PROMPTS, inside=True, steps=steps, seed=1, piece=PIECE_ALIGN)
    theirs, reference = _run(alone, PROMPTS, inside=False, steps=steps, seed=1, piece=None)
    assert mixed.prefill_forwards == len(RUNNING)  # the running sequences' opens: every prompt chunk ran inside a step
    for mine, ref in zip(ours, theirs, strict=True):
        for (a, tokens, position, logits, hidden), (a2, tokens2, position2, logits2, hidden2) in zip(mine, ref, strict=True):
            assert (a, tokens, position) == (a2, tokens2, position2)
            assert torch.equal(logits, logits2) and torch.equal(hidden, hidden2)
    for seq, ref, prompt in zip(opened, reference, PROMPTS, strict=True):
        assert seq.pending == ref.pending
        assert torch.equal(seq.first_logits, ref.first_logits)
        assert torch.equal(seq.prompt_hidden, ref.prompt_hidden)
        assert _same([t for layer in mixed.slot_tensors(seq.slot, len(prompt)) for t in layer],
                     [t for layer in alone.slot_tensors(ref.slot, len(prompt)) for t in layer])
    # the first prompt's whole chunk went to the cache from inside the steps: an open of it with
    # another tail restores it, and its start equals a cold one
    tail = PROMPTS[0][:CHUNK] + [2, 3, 4]
    hits = mixed.prefix_cache.stats.cached_tokens
    for seq in opened:
        mixed.close(seq)
    cached = mixed.open(tail, SamplingParams(), 4, want_hidden=True)
    assert mixed.prefix_cache.stats.cached_tokens - hits == CHUNK
    fresh = Engine(model, 1, SEQ_LEN, max_k=3, rollback_mode=rollback, cuda_graphs=False, prefill_chunk=CHUNK)
    cold = fresh.open(tail, SamplingParams(), 4, want_hidden=True)
    assert torch.equal(cached.first_logits, cold.first_logits)
    assert torch.equal(cached.prompt_hidden, cold.prompt_hidden)


def test_a_step_with_no_request_to_run_prefills_its_openings(load_target):
    model = load_target("qwen3_5_text")
    engine = Engine(model, 2, SEQ_LEN, max_k=3, cuda_graphs=False, prefill_chunk=CHUNK)
    alone = Engine(model, 1, SEQ_LEN, max_k=3, cuda_graphs=False, prefill_chunk=CHUNK)
    finished = engine.open([4, 5], SamplingParams(), 1)  # its one token is out: its step is refused
    opening = engine.opening(PROMPTS[1], SamplingParams(), 4)
    results = engine.step([StepRequest(finished, [])], [opening])
    assert results[0].error is not None and results[0].error.code == "failed_precondition"
    assert opening.logits is not None and engine.prefill_forwards == 2  # the finished one's open, then the prompt's
    assert torch.equal(opening.sequence().first_logits, alone.open(PROMPTS[1], SamplingParams(), 4).first_logits)


def test_a_failed_step_fails_its_openings_and_frees_their_slots(load_target, monkeypatch):
    model = load_target("qwen3_5_text")
    engine = Engine(model, 3, SEQ_LEN, max_k=3, cuda_graphs=False, prefill_chunk=CHUNK)
    seq = engine.open(RUNNING[0], SamplingParams(), 8)
    openings = [engine.opening(p, SamplingParams(), 4) for p in PROMPTS]

    def broken(*args, **kwargs):
        raise RuntimeError("the device fell over")

    monkeypatch.setattr(model, "compute", broken)
    with pytest.raises(RuntimeError, match="fell over"):
        engine.step([StepRequest(seq, [1, 2])], openings)
    monkeypatch.undo()
    assert all(o.slot is None for o in openings) and seq.lost
    engine.close(seq)
    slots = [engine.admit() for _ in range(3)]  # all three came back
    assert len(set(slots)) == 3


def test_pieces_follow_the_alignment_and_the_chunks():
    class _Engine:  # what Opening.next_chunk reads
        prefill_chunk = CHUNK

    opening = Opening.__new__(Opening)
    opening.engine, opening.prompt, opening.position = _Engine(), list(range(2 * CHUNK + 7)), 0
    assert opening.next_chunk() == (0, CHUNK)
    assert opening.next_chunk(PIECE_ALIGN) == (0, PIECE_ALIGN)
    opening.position = PIECE_ALIGN
    assert opening.next_chunk() == (PIECE_ALIGN, CHUNK)  # the rest of its chunk, never past its boundary
    assert opening.next_chunk(3 * PIECE_ALIGN) == (PIECE_ALIGN, CHUNK)
    opening.position = 2 * CHUNK
    assert opening.next_chunk(PIECE_ALIGN) == (2 * CHUNK, 2 * CHUNK + 7)  # the prompt's end


@pytest.mark.parametrize("name", ["qwen3_5_text", "kimi_linear"])
def test_prefills_programs_of_many_rows_give_the_same_bits(load_target, model_device, monkeypatch, name):
    """PREFILL_CONV_RUN_ROWS (prefill's short conv in runs of a few rows) and HEADS_ROWS_PER_PROGRAM
    (GDN's head split, several rows a program): which program computes a row never changes its
    bits, so a prompt's every logit row and its slot's state equal those of a step's programs,
    torch.equal; then the prompts-inside-steps test holds with them. The CPU reference has no
    programs, so this runs with --model-device cuda."""
    if model_device != "cuda":
        pytest.skip("the programs are the Triton kernels' (--model-device cuda)")
    from hybrid_kernels import gdn_heads
    from verifier.model.layers import linear_attention

    model = load_target(name)
    prompt = PROMPTS[0]
    pools, rows = [], []
    monkeypatch.setattr(gdn_heads, "HEADS_MANY_ROWS", 1)  # this prompt's launches count as many rows
    for run_rows, heads_rows in ((0, 1), (8, 4)):
        monkeypatch.setattr(linear_attention, "PREFILL_CONV_RUN_ROWS", run_rows)
        monkeypatch.setattr(gdn_heads, "HEADS_ROWS_PER_PROGRAM", heads_rows)
        pool = model.new_pool(1, SEQ_LEN)
        rows.append(model.prefill(pool, pool.admit(), prompt, chunk=CHUNK, all_logits=True))
        pools.append(pool)
    assert torch.equal(rows[0], rows[1])
    for a, b in zip(pools[0].layers, pools[1].layers, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(vars(a).values(), vars(b).values()) if isinstance(x, torch.Tensor))
    test_prompts_inside_steps_equal_steps_and_opens_alone(load_target, name, "woa")
