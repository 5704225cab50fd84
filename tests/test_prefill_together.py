"""Prompts opened together share prefill forwards (Engine.advance_openings): every prompt's first
logits, hidden rows, cached prefixes and slot state are those of its own open alone, torch.equal,
whatever prompts its chunks shared forwards with. On the Triton backend (--model-device cuda) a
turn of several prompts is one forward; the CPU reference runs them one a forward."""

import pytest
import torch

from verifier.engine import Engine
from verifier.params import SamplingParams

CHUNK = 4
PROMPTS = [[5, 9, 2, 7, 11, 3, 8, 6, 4, 10, 12, 13, 1], [14, 2], [7, 7, 3, 9, 1, 5, 2, 8, 6]]  # 4, 1 and 3 chunks


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _open_together(engine: Engine, prompts: list[list[int]]) -> tuple[list, int]:
    """Open `prompts` at once, every turn advancing all that are not in yet -> (sequences, turns)."""
    openings = [engine.opening(p, SamplingParams(), 4, want_hidden=True) for p in prompts]
    turns = 0
    while not all(engine.advance_openings(openings)):
        turns += 1
    return [o.sequence() for o in openings], turns + 1


@pytest.mark.parametrize("name", ["qwen3_5_text", "kimi_linear", "qwen3_next_moe"])
def test_prompts_prefilled_together_equal_each_alone(load_target, name):
    model = load_target(name)
    together = Engine(model, 3, 32, max_k=4, cuda_graphs=False, prefill_chunk=CHUNK, prefix_cache_bytes=1 << 30)
    together.prefix_cache.keep_hidden = True  # as a server with an MTP head keeps them
    alone = Engine(model, 1, 32, max_k=4, cuda_graphs=False, prefill_chunk=CHUNK)
    seqs, turns = _open_together(together, PROMPTS)
    assert turns == 4  # the longest prompt's chunks: the others rode along
    chunks = sum(-(-len(p) // CHUNK) for p in PROMPTS)
    assert together.prefill_forwards == (turns if together.together else chunks)
    for seq, prompt in zip(seqs, PROMPTS):
        ref = alone.open(prompt, SamplingParams(), 4, want_hidden=True)
        assert torch.equal(seq.first_logits, ref.first_logits)
        assert torch.equal(seq.prompt_hidden, ref.prompt_hidden)
        for mine, theirs in zip(together.slot_tensors(seq.slot, len(prompt)), alone.slot_tensors(ref.slot, len(prompt)), strict=True):
            assert _same(mine, theirs)
        alone.close(ref)
        together.close(seq)
    # the same prompts with other tails, together again: their whole chunks come from the cache
    # (restored, not recomputed), and the starts still equal cold ones
    tails = [p[: len(p) // CHUNK * CHUNK] + [20, 21] for p in PROMPTS]
    hits = together.prefix_cache.stats.cached_tokens
    seqs, _ = _open_together(together, tails)
    assert together.prefix_cache.stats.cached_tokens - hits == sum(len(p) // CHUNK * CHUNK for p in PROMPTS)
    for seq, prompt in zip(seqs, tails):
        ref = alone.open(prompt, SamplingParams(), 4, want_hidden=True)
        assert torch.equal(seq.first_logits, ref.first_logits)
        assert torch.equal(seq.prompt_hidden, ref.prompt_hidden)
        alone.close(ref)


def test_a_failed_forward_fails_every_opening_in_it_and_frees_their_slots(load_target, monkeypatch):
    model = load_target("qwen3_5_text")
    engine = Engine(model, 2, 32, max_k=4, cuda_graphs=False, prefill_chunk=CHUNK)
    openings = [engine.opening(p, SamplingParams(), 4) for p in PROMPTS[:2]]

    def broken(*args, **kwargs):
        raise RuntimeError("the device fell over")

    monkeypatch.setattr(model, "forward", broken)
    monkeypatch.setattr(model, "prefill", broken)
    with pytest.raises(RuntimeError, match="fell over"):
        engine.advance_openings(openings)
    monkeypatch.undo()
    assert all(o.slot is None for o in openings)
    slots = [engine.admit(), engine.admit()]  # both came back
    assert sorted(slots) == sorted(set(slots))
