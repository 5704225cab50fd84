"""The engine's door for a caller that keeps a slot as its own context (the model drafter): admit,
prefill, consume rows through the step's path, save and restore the recurrent state, read a
slot's tensors; what it gives is what the engine's own steps give, bitwise."""

import pytest
import torch

from verifier.engine import Engine

PROMPT = [5, 9, 2, 7, 11, 3]
MORE = [4, 8, 6, 1]


@pytest.mark.parametrize("name", ["qwen3_5_text", "kimi_linear"])
@pytest.mark.parametrize("max_k", [0, 4])
def test_consuming_rows_at_once_equals_one_by_one(load_target, name, max_k):
    """Rows consumed together give the last row's logits and the slot's state that consuming them
    one at a time gives (verify rows are serial decode rows), in a pool that carries rows or folds."""
    model = load_target(name)
    together, alone = Engine(model, 1, 32, max_k=max_k, cuda_graphs=False), Engine(model, 1, 32, max_k=max_k, cuda_graphs=False)
    a, b = together.admit(), alone.admit()
    assert torch.equal(together.prefill(a, PROMPT), alone.prefill(b, PROMPT))
    rows = MORE[: max_k + 1] if max_k else MORE[:1]
    last = together.consume(a, len(PROMPT), rows)
    for i, token in enumerate(rows):
        one = alone.consume(b, len(PROMPT) + i, [token])
    assert torch.equal(last, one)
    end = len(PROMPT) + len(rows)
    for mine, theirs in zip(together.slot_tensors(a, end), alone.slot_tensors(b, end), strict=True):
        assert all(torch.equal(x, y) for x, y in zip(mine, theirs, strict=True))


def test_restored_recurrent_state_replays_the_same_bits(load_target):
    """save_recurrent, consume, restore_recurrent, consume the same rows again: the same logits and
    the same slot (a restore leaves no carried rows behind: the saved state is the committed one)."""
    model = load_target("qwen3_next_moe")
    engine = Engine(model, 2, 32, max_k=4, cuda_graphs=False)
    slot = engine.admit()
    engine.prefill(slot, PROMPT)
    engine.consume(slot, len(PROMPT), MORE[:3])  # kept rows carried: the saved state must apply them
    start = len(PROMPT) + 3
    saved = engine.save_recurrent(slot)
    first = engine.consume(slot, start, MORE)
    state = engine.slot_tensors(slot, start + len(MORE))
    engine.restore_recurrent(slot, saved)
    again = engine.consume(slot, start, MORE)
    assert torch.equal(first, again)
    for mine, theirs in zip(engine.slot_tensors(slot, start + len(MORE)), state, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(mine, theirs, strict=True))
    engine.release(slot)
    assert engine.n_slots == 2 and engine.max_seq_len == 32 and not engine.graphed and engine.max_graph_rows is None
