"""The host side of an engine step, which a batch-1 step's GPU waits for: the step's tokens as a
list (checked with builtins, written into the packed inputs as they are), a batch that fits its
bucket its own padding, the emitted logits rows kept in one copy (or copied before the acceptance), the carried counts attached,
and RowBatch's checks. Each shortcut is held to what the longer path gives."""

import pytest
import torch

from verifier import engine as engine_module
from verifier.engine import Engine, StepRequest, StepResult
from verifier.model.padding import BucketShape, bucket_for, bucket_shapes, pad_batch
from verifier.model.rollback import with_carried
from verifier.model.rows import RowBatch, check_rows
from verifier.model.rows import StepInputs

BATCHES = [
    RowBatch((0,), (5,), (1,)),  # a decode
    RowBatch((2,), (40,), (9,)),  # one sequence at K = 8
    RowBatch((3, 0, 1), (7, 0, 12), (2, 5, 1)),  # mixed K
    RowBatch((1, 2), (3, 4), (3, 1), carried=(2, 0)),
    # one row a sequence, which fill writes by a shorter path: a decode of three, one padded with
    # one-row sequences in the scratch slot (a bucket of 3 rows for 2 sequences), one with carried rows
    RowBatch((4, 0, 2), (9, 3, 30), (1, 1, 1)),
    RowBatch((1, 0, 5), (6, 2, 0), (1, 1, 1), scratch_slot=5),
    RowBatch((1, 3), (6, 2), (1, 1), carried=(0, 3)),
]


def _filled(batch: RowBatch, tokens) -> torch.Tensor:
    return StepInputs(batch.n_rows, len(batch.slots), "cpu").fill(tokens, batch).buffer


@pytest.mark.parametrize("batch", BATCHES)
def test_tokens_as_a_list_fill_what_a_tensor_fills(batch):
    ids = [(17 * r + 3) % 1000 for r in range(batch.n_rows)]
    for given in (ids, ids[:-1]):  # all rows, or a first part (the rest 0, as for padding rows)
        assert torch.equal(_filled(batch, given), _filled(batch, torch.tensor(given, dtype=torch.int64)))
    filled = StepInputs(batch.n_rows, len(batch.slots), "cpu").fill(ids, batch)
    assert filled.tokens.tolist() == ids
    assert filled.fill(ids[:1], batch).tokens.tolist() == ids[:1] + [0] * (batch.n_rows - 1)  # a reused buffer: the rest 0
    filled.fill(ids, batch)
    assert filled.row_slots.tolist() == [slot for slot, count in zip(batch.slots, batch.counts) for _ in range(count)]
    assert filled.positions.tolist() == [start + r for start, count in zip(batch.starts, batch.counts) for r in range(count)]
    assert filled.cu_rows.tolist() == [0, *torch.tensor(batch.counts).cumsum(0).tolist()]
    assert filled.seq_slots.tolist() == list(batch.slots)
    assert filled.carried.tolist() == (list(batch.carried) if batch.carried else [0] * len(batch.slots))


def test_one_row_sequences_fill_what_the_general_path_fills():
    """A batch of one row a sequence takes fill's shorter path; a buffer first filled by the general
    path with another batch of the same shape (every word written) ends bitwise the same."""
    decode = RowBatch((4, 0, 2), (9, 3, 30), (1, 1, 1), carried=(0, 2, 0))
    other = RowBatch((7, 1, 3), (50, 8, 1), (2, 0, 1), scratch_slot=1, carried=(1, 0, 4))  # counts not all 1
    reused = StepInputs(3, 3, "cpu").fill([11, 12, 13], other).fill([5, 6, 7], decode)
    assert torch.equal(reused.buffer, _filled(decode, [5, 6, 7]))
    assert reused.row_slots.tolist() == [4, 0, 2] and reused.positions.tolist() == [9, 3, 30]
    assert reused.cu_rows.tolist() == [0, 1, 2, 3] and reused.carried.tolist() == [0, 2, 0]


def test_a_batch_that_fits_its_bucket_is_its_own_padding():
    """pad_batch hands back a batch that fits its bucket as it is, and one that does not gets the
    bucket's shape with its own sequences first (test_padded_steps holds the padding itself)."""
    n_slots = 8
    for batch in (RowBatch((4,), (30,), (1,)), RowBatch((0, 1), (2, 3), (1, 1))):
        shape = bucket_for(bucket_shapes((batch.n_rows,), n_slots), batch)
        assert (shape.rows, shape.sequences) == (batch.n_rows, len(batch.slots))
        assert pad_batch(batch, shape, n_slots) is batch
        wider = bucket_for(bucket_shapes((batch.n_rows + 3,), n_slots), batch)
        padded = pad_batch(batch, wider, n_slots)
        assert padded is not batch and (padded.n_rows, len(padded.slots)) == (wider.rows, wider.sequences)
        assert padded.slots[: len(batch.slots)] == batch.slots and padded.scratch_slot == n_slots


def test_a_reused_buffer_fills_what_a_fresh_one_fills():
    """fill rewrites the rows' slots and sequences only when the batch's (slots, counts) change:
    a buffer reused across steps of one layout (new starts, tokens, carried), of another layout, and
    after a decode's shorter path ends bitwise as a fresh buffer filled with the last batch."""
    steps = [
        RowBatch((3, 0, 5), (7, 0, 0), (5, 4, 0), scratch_slot=5),
        RowBatch((3, 0, 5), (12, 1, 0), (5, 4, 0), scratch_slot=5, carried=(2, 1, 0)),  # same layout, moved on
        RowBatch((0, 3, 5), (12, 1, 0), (5, 4, 0), scratch_slot=5),  # the slots swapped
        RowBatch((0, 3, 5), (12, 1, 0), (6, 3, 0), scratch_slot=5),  # the counts changed
        RowBatch((4, 1, 2, 5, 5, 5, 5, 5, 5), tuple(range(9)), (1,) * 9, scratch_slot=5),  # a decode of 9 rows
        RowBatch((0, 3, 5), (20, 9, 0), (6, 3, 0), scratch_slot=5),  # the layout before the decode
    ]
    reused = StepInputs(9, 9, "cpu")
    for i, batch in enumerate(steps):
        padded = pad_batch(batch, BucketShape(9, 9), 5) if len(batch.slots) < 9 else batch
        ids = [(31 * r + i) % 1000 for r in range(padded.n_rows)]
        reused.fill(ids, padded)
        assert torch.equal(reused.buffer, _filled(padded, ids)), f"step {i}: the reused buffer differs from a fresh one"


def test_check_rows_takes_a_list(load_target):
    model = load_target("qwen3_next_moe")
    engine = Engine(model, 2, 32, cuda_graphs=False)
    batch = RowBatch((0,), (0,), (3,))
    vocab, room = model.config.vocab_size, engine.pool.max_seq_len
    check_rows([0, 5, vocab - 1], batch, room, vocab)
    with pytest.raises(AssertionError, match="token id out of range"):
        check_rows([0, vocab, 1], batch, room, vocab)
    with pytest.raises(AssertionError, match="token id out of range"):
        check_rows([-1, 2, 1], batch, room, vocab)
    with pytest.raises(AssertionError, match=r"tokens has shape \[2\], expected \[3\]"):
        check_rows([1, 2], batch, room, vocab)
    with pytest.raises(AssertionError, match="token id out of range"):  # a tensor, as other callers pass
        check_rows(torch.tensor([1, 2, vocab]), batch, room, vocab)


# (first row, emitted rows) of each sequence wanting its logits: one range as a decode's (each
# sequence's row right after the last's), or rows apart as a verify's (emitted rows at the start of
# each sequence's K + 1; the early copy spans every row from the first's to the last's end)
LAYOUTS = {"one range": ([(0, 1), (1, 1), (2, 1), (3, 1)], 4), "rows apart": ([(0, 2), (9, 1), (12, 4)], 18),
           "one sequence": ([(9, 3)], 18), "one sequence, all its rows": ([(9, 9)], 18)}


@pytest.mark.parametrize("early", [False, True], ids=["after acceptance", "copied early"])
@pytest.mark.parametrize("layout", LAYOUTS.keys())
def test_keep_rows_gives_each_result_its_rows_copied(layout, early):
    logits = torch.randn(20, 6)
    spans, end = LAYOUTS[layout]
    results = [StepResult(0, [], 0, None, None) for _ in spans]
    copy = (spans[0][0], logits[spans[0][0] : end].clone()) if early else None
    Engine._keep_rows(logits, [(result, first, n) for result, (first, n) in zip(results, spans)], copy)
    expected = [logits[first : first + n].clone() for first, n in spans]
    logits.fill_(float("nan"))  # the next replay overwrites the verify's logits
    for result, want in zip(results, expected):
        assert torch.equal(result.logits, want)


def test_copy_early_spans_the_wanting_sequences_within_its_budget(monkeypatch):
    logits = torch.randn(27, 6)
    batch = RowBatch((0, 1, 2), (0, 0, 0), (9, 9, 9))
    def requests(*wants):
        return [StepRequest(None, [], want_logits=w) for w in wants]
    assert Engine._copy_early(logits, batch, requests(False, False, False)) is None
    first, rows = Engine._copy_early(logits, batch, requests(False, True, False))
    assert first == 9 and torch.equal(rows, logits[9:18]) and rows.data_ptr() != logits[9:18].data_ptr()
    first, rows = Engine._copy_early(logits, batch, requests(True, False, True))  # the span, the middle sequence too
    assert first == 0 and torch.equal(rows, logits)
    monkeypatch.setattr(engine_module, "EARLY_LOGITS_BYTES", 9 * 6 * 4)
    assert Engine._copy_early(logits, batch, requests(True, False, True)) is None  # past the budget: after acceptance
    assert Engine._copy_early(logits, batch, requests(False, False, True))[0] == 18


def test_with_carried_attaches_each_slots_count(load_target):
    engine = Engine(load_target("qwen3_next_moe"), 4, 32, max_k=3, cuda_graphs=False)
    pool = engine.pool
    pool.carried[1], pool.carried[3] = 2, 4
    batch = RowBatch((3, 0, 1), (5, 6, 7), (2, 4, 1))
    carried = with_carried(batch, pool)
    assert (carried.slots, carried.starts, carried.counts, carried.carried) == (batch.slots, batch.starts, batch.counts, (4, 0, 2))
    with pytest.raises(ValueError, match="slot 2: a verify of 5 rows in a pool that carries at most 4"):
        with_carried(RowBatch((0, 2), (0, 0), (1, 5)), pool)
    none_carry = RowBatch((0, 2), (5, 6), (1, 3))  # slots 0 and 2 carry nothing: the batch itself
    assert with_carried(none_carry, pool) is none_carry


def test_row_batch_checks():
    with pytest.raises(AssertionError, match="appears twice"):
        RowBatch((1, 1), (0, 0), (1, 1))
    with pytest.raises(AssertionError, match="at least one row"):
        RowBatch((1, 2), (0, 0), (1, 0))
    with pytest.raises(AssertionError, match="at least one row"):
        RowBatch((1,), (-1,), (1,))
    with pytest.raises(AssertionError, match="differ in length"):
        RowBatch((1, 2), (0,), (1, 1))
    with pytest.raises(AssertionError, match="carried needs one count"):
        RowBatch((1, 2), (0, 0), (1, 1), carried=(1,))
    # padding sequences share the scratch slot and may have no rows
    padded = RowBatch((0, 9, 9, 9), (3, 0, 8, 0), (1, 8, 1, 0), scratch_slot=9)
    assert padded.n_rows == 10
    with pytest.raises(AssertionError, match="at least one row"):
        RowBatch((0, 9), (3, 0), (0, 2), scratch_slot=9)


def test_a_prefill_forward_never_waits_for_the_device(load_target, model_device):
    """A prompt's chunk moves its tokens and batch tensors to the GPU through pinned memory and picks
    each sequence's last row on the device (verifier/model/rows.py to_device): no host sync in its
    forward, so the host launches the next chunk while this one runs. On the CPU every copy is a
    plain one: the same values, checked against a forward that copies the old way."""
    from verifier.model.rows import to_device

    model = load_target("qwen3_next_moe")
    pool = model.new_pool(6, 64)  # every forward prefills two fresh slots: prefill commits its rows
    tokens = torch.tensor([5, 9, 2, 7, 11, 3, 8, 6, 4], dtype=torch.int64)
    assert torch.equal(to_device(tokens, model.device).cpu(), tokens)
    first = model.forward(tokens, RowBatch((0, 1), (0, 0), (4, 5)), pool, row_invariant=False, last_only=True)
    again = RowBatch((2, 3), (0, 0), (4, 5))
    if model_device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            second = model.forward(tokens, again, pool, row_invariant=False, last_only=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    else:
        second = model.forward(tokens, again, pool, row_invariant=False, last_only=True)
    assert torch.equal(first, second)
    assert (again.cu_rows(model.device)[1:] - 1).tolist() == [3, 8]  # each sequence's last row
    if model_device == "cuda":  # the Triton backend's rows are row-invariant: the picked rows are the whole forward's
        whole = model.forward(tokens, RowBatch((4, 5), (0, 0), (4, 5)), pool, row_invariant=False)
        assert torch.equal(first, whole[[3, 8]])
