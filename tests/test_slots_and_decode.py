"""Slot state and batched decode: admission, reuse, and decode of many slots at different positions."""

import pytest
import torch

from verifier.model import PoolFullError, RowBatch
from verifier.model.state import RecurrentState
from verifier.model.step import decode

FAMILIES = ["qwen3_next_moe", "qwen3_5_text", "kimi_linear", "kimi_linear_qlora"]


def _prompts(vocab: int, lengths=(5, 9, 3)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def _snapshot(pool, slot):
    return [t[slot].clone() for layer in pool.layers for t in layer.named_tensors().values()]


@pytest.mark.parametrize("name", FAMILIES)
def test_batched_decode_is_bitwise_equal_to_decoding_each_slot_alone(load_target, name):
    model = load_target(name)
    prompts = _prompts(model.config.vocab_size)

    def run(together: bool):
        pool = model.new_pool(len(prompts), 32)
        slots = [pool.admit() for _ in prompts]
        last = [model.prefill(pool, s, p) for s, p in zip(slots, prompts)]
        positions = [len(p) for p in prompts]
        rows = []
        for _ in range(6):
            tokens = [int(l.argmax()) for l in last]
            if together:
                out = decode(model, pool, slots, positions, tokens)
                last = list(out)
            else:
                last = [decode(model, pool, [s], [p], [t])[0] for s, p, t in zip(slots, positions, tokens)]
            rows.append(torch.stack(last))
            positions = [p + 1 for p in positions]
        return torch.stack(rows), [_snapshot(pool, s) for s in slots]

    logits_together, state_together = run(True)
    logits_alone, state_alone = run(False)
    assert torch.equal(logits_together, logits_alone)
    for a, b in zip(state_together, state_alone):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_reused_slot_is_zeroed_and_behaves_like_a_fresh_one(load_target):
    model = load_target("qwen3_next_moe")
    prompt = _prompts(model.config.vocab_size)[0]
    pool = model.new_pool(1, 32)
    slot = pool.admit()
    fresh = model.prefill(pool, slot, prompt)
    model.prefill(pool, slot, [7, 8, 9, 10])  # dirty the slot further
    pool.release(slot)
    assert pool.admit() == slot
    for layer in pool.layers:
        if isinstance(layer, RecurrentState):
            assert not layer.conv[slot].any() and not layer.recurrent[slot].any()
    assert torch.equal(model.prefill(pool, slot, prompt), fresh)


def test_pool_full_and_release_errors(load_target):
    model = load_target("qwen3_5_text")
    pool = model.new_pool(2, 8)
    a, b = pool.admit(), pool.admit()
    assert {a, b} == {0, 1} and pool.n_free == 0
    with pytest.raises(PoolFullError, match="all 2 slots are in use"):
        pool.admit()
    pool.release(a)
    with pytest.raises(ValueError, match="is not in use"):
        pool.release(a)
    with pytest.raises(ValueError, match="outside the pool"):
        pool.release(5)


def test_bad_rows_are_asserted_before_any_state_changes(load_target):
    """Below the engine a bad batch is a caller bug: an assertion, raised before any state changes."""
    model = load_target("kimi_linear")
    pool = model.new_pool(2, 16)
    s0, s1 = pool.admit(), pool.admit()
    model.prefill(pool, s0, [4, 5, 6])
    model.prefill(pool, s1, [7, 8])
    before = _snapshot(pool, s0) + _snapshot(pool, s1)
    with pytest.raises(AssertionError, match="token id out of range"):
        decode(model, pool, [s0, s1], [3, 2], [5, model.config.vocab_size])
    with pytest.raises(AssertionError, match="past the pool's max_seq_len 16"):
        decode(model, pool, [s0, s1], [3, 16], [5, 6])
    with pytest.raises(AssertionError, match="a slot appears twice"):
        RowBatch(slots=(s0, s0), starts=(3, 4), counts=(1, 1))
    after = _snapshot(pool, s0) + _snapshot(pool, s1)
    assert all(torch.equal(x, y) for x, y in zip(before, after))


def test_chunked_prefill_matches_one_pass(load_target):
    model = load_target("qwen3_next_moe")
    prompt = _prompts(model.config.vocab_size, lengths=(23,))[0]
    pool = model.new_pool(2, 32)
    one = model.prefill(pool, pool.admit(), prompt, all_logits=True)
    chunked = model.prefill(pool, pool.admit(), prompt, chunk=5, all_logits=True)
    # Chunks batch other rows together, so this is a tolerance check (not the decode contract).
    assert (one - chunked).abs().max() <= 1e-5 * one.abs().max()
