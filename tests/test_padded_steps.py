"""Graph-bucket padding at the engine level, on the CPU reference backend: a step padded to its
bucket (the padding code path the CUDA graphs replay, run eagerly) gives every real row and every
real slot's state torch.equal to the unpadded step, for mixed K and both rollback modes; the
scratch slot's conv window and recurrent state stay zero. Also: the bucket list, step_costs,
steps that want no logits, the sequences a padded batch's walks are split for, and the buckets of
one sequence (the bucket a step picks, the batch its graphs are captured on, what that capture runs)."""

import pytest
import torch

from bitexact.serial import serial_run
from hybrid_kernels.short_conv import CONV_MAX_RUNS, conv_runs
from verifier.engine import Engine, StepRequest
from verifier.model.graphs import DEFAULT_GRAPH_ROWS
from verifier.model.padding import (PAD_CHUNK, WALK_ROWS, BucketShape, bucket_for, bucket_shapes, buckets, capture_batch,
                                    pad_batch, walk_sequences)
from verifier.model.rollback import ROLLBACK_MODES
from verifier.model.rows import RowBatch
from verifier.model.state import RecurrentState
from verifier.params import SamplingParams

BUCKETS = (2, 4, 16)
MAX_SEQ_LEN, MAX_K = 64, 5
PROMPTS = [[5, 6, 7], [11, 3, 9, 2, 8], [4, 4]]
# drafts per sequence and step: rows 3 (bucket 4: one padding row), 7 (16: 9 padding rows in two
# padding sequences of 8 and 1 sharing the scratch slot), 14 (16: 2 padding rows, then an empty
# padding sequence), 10 (16), 18 (past the largest bucket: eager, unpadded), and two sequences of
# 2 rows each (bucket 4 exactly: two empty padding sequences)
K_MIXES = [[0, 0, 0], [1, 3, 0], [5, 2, 4], [3, 3, 1], [5, 5, 5], [1, 1, None]]


def _engine(model, mode, pad):
    engine = Engine(model, len(PROMPTS), MAX_SEQ_LEN, max_k=MAX_K, rollback_mode=mode, cuda_graphs=False, graph_rows=BUCKETS)
    engine.runner.pad_eagerly = pad
    return engine


def _drafts(plain: list[int], emitted: int, k: int, vocab: int) -> list[int]:
    """k drafts after `emitted` tokens of the plain stream: right ones, the last one wrong when k > 2
    (so steps accept all, some and none)."""
    drafts = plain[emitted : emitted + k]
    if k > 2:
        drafts[-1] = (drafts[-1] + 1) % vocab
    return drafts


@pytest.mark.parametrize("mode", ROLLBACK_MODES)
@pytest.mark.parametrize("family", ["qwen3_next_moe", "kimi_linear"])
def test_padded_step_equals_unpadded(load_target, family, mode):
    model = load_target(family)
    vocab = model.config.vocab_size
    plain = [serial_run(Engine(model, 1, MAX_SEQ_LEN, max_k=0, cuda_graphs=False), p, 40).tokens for p in PROMPTS]
    engines = [_engine(model, mode, pad=False), _engine(model, mode, pad=True)]
    seqs = [[e.open(p, SamplingParams(), 40, eos_ids=()) for p in PROMPTS] for e in engines]
    emitted = [1] * len(PROMPTS)
    for mix in K_MIXES:
        live = [s for s, k in enumerate(mix) if k is not None]
        results = [e.step([StepRequest(ss[s], _drafts(plain[s], emitted[s], mix[s], vocab)) for s in live])
                   for e, ss in zip(engines, seqs)]
        for s, unpadded, padded in zip(live, *results):
            assert padded.error is None and unpadded.error is None
            assert (padded.tokens, padded.accepted, padded.position) == (unpadded.tokens, unpadded.accepted, unpadded.position)
            assert torch.equal(padded.logits, unpadded.logits), f"{family} {mode} K {mix}: sequence {s}'s logits differ"
            assert padded.tokens == plain[s][emitted[s] : emitted[s] + len(padded.tokens)]
            emitted[s] += len(padded.tokens)
        real = slice(0, len(PROMPTS))
        for index, (a, b) in enumerate(zip(engines[0].pool.layers, engines[1].pool.layers)):
            others = b.named_tensors()
            for name, t in a.named_tensors().items():
                assert torch.equal(t[real], others[name][real]), f"K {mix}: layer {index} {name}"
        _assert_scratch_clean(engines[1])


def _assert_scratch_clean(engine):
    """The scratch slot's recurrent-layer state: its windows, states and carried rows, all zero."""
    scratch = engine.pool.scratch_slot
    for layer in engine.pool.layers:
        if isinstance(layer, RecurrentState):
            for name, t in layer.named_tensors().items():
                assert not t[scratch].any(), f"padding wrote the scratch slot's {name}"


def test_default_buckets_stop_at_the_rows_a_step_can_reach(load_target):
    """At most n_slots x (max_k + 1) rows run in a step: the default buckets stop at the first one
    that holds them (8 slots at K = 8: 72 rows, so up to 80, never the buckets of 96 .. 576)."""
    from verifier.model.graphs import reachable_rows

    assert reachable_rows((1, 2, 4, 8), 3) == (1, 2, 4) and reachable_rows((1, 2, 4, 8), 4) == (1, 2, 4)
    assert reachable_rows((1, 2, 4, 8), 9) == (1, 2, 4, 8) and reachable_rows((1, 2, 4, 8), 1) == (1,)
    model = load_target("qwen3_next_moe")
    engine = Engine(model, 8, 1024)
    assert [s.rows for s in engine.runner.shared] == [r for r in DEFAULT_GRAPH_ROWS if r <= 80]
    assert [s.rows for s in Engine(model, 64, 1024).runner.shared] == list(DEFAULT_GRAPH_ROWS)
    assert [s.rows for s in Engine(model, 3, 1024, max_k=0).runner.shared] == [1, 2, 3]


def test_buckets_fit_the_context(load_target):
    model = load_target("qwen3_next_moe")
    engine = Engine(model, 2, 20)
    assert [s.rows for s in engine.runner.shared] == [r for r in DEFAULT_GRAPH_ROWS if r <= 20]
    # min(rows, n_slots + ceil(rows / PAD_CHUNK)): rows 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20
    assert [s.sequences for s in engine.runner.shared] == [1, 2, 3, 3, 3, 3, 3, 4, 4, 4, 5]
    # one-sequence buckets up to max_k + 1 = 9 rows, and never past the largest shared bucket
    def one_sequence(e):
        return sorted(s.rows for s in e.runner.buckets if s.sequences == 1)
    assert one_sequence(engine) == list(range(1, 10))
    assert one_sequence(Engine(model, 2, 20, max_k=30)) == list(range(1, 21))
    assert one_sequence(Engine(model, 2, 20, max_k=0)) == [1]
    assert len(engine.runner.buckets) == len(engine.runner.shared) + 8  # (1, 1) once
    assert engine.runner.buckets == sorted(engine.runner.buckets, key=lambda s: (s.rows, s.sequences))
    with pytest.raises(ValueError, match="passes max_seq_len 20"):
        Engine(model, 2, 20, graph_rows=(4, 32))
    with pytest.raises(ValueError, match="strictly increasing"):
        Engine(model, 2, 20, graph_rows=(4, 4, 8))


def test_eager_step_costs_touch_no_real_slot(load_target):
    model = load_target("qwen3_next_moe")
    engine = Engine(model, 2, MAX_SEQ_LEN, graph_rows=BUCKETS, cuda_graphs=False)
    engine.warm_up()  # eager: nothing to capture
    assert engine.graph_captures == 0 and engine.runner.max_graph_rows is None
    seq = engine.open([5, 6, 7], SamplingParams(), 10, eos_ids=())
    before = [t.clone() for layer in engine.pool.layers for t in layer.named_tensors().values()]
    costs = engine.step_costs()
    assert 1 <= len(costs) and list(costs) == list(BUCKETS[: len(costs)])
    assert all(isinstance(t, float) and t > 0 for t in costs.values())
    after = [t for layer in engine.pool.layers for t in layer.named_tensors().values()]
    for a, b in zip(before, after):
        assert torch.equal(a[: engine.pool.n_slots], b[: engine.pool.n_slots]), "step_costs changed a real slot"
    _assert_scratch_clean(engine)
    (result,) = engine.step([StepRequest(seq, [1, 2])])
    assert result.error is None


def test_want_logits_false_copies_none(load_target):
    model = load_target("qwen3_next_moe")
    engines = [Engine(model, 1, MAX_SEQ_LEN, cuda_graphs=False) for _ in range(2)]
    seqs = [e.open([5, 6, 7], SamplingParams(), 10, eos_ids=()) for e in engines]
    with_logits = engines[0].step([StepRequest(seqs[0], [1, 2])])[0]
    without = engines[1].step([StepRequest(seqs[1], [1, 2], want_logits=False)])[0]
    assert without.logits is None and with_logits.logits.shape[0] == len(with_logits.tokens)
    assert (without.tokens, without.position) == (with_logits.tokens, with_logits.position)


@pytest.mark.parametrize("n_slots", [1, 2, 3, 8, 20])
def test_padding_sequences_hold_at_most_pad_chunk_rows(n_slots):
    """Every default bucket and every real step that fits it (S sequences of R rows in all, S <= min(R,
    n_slots), R <= R_b; the padding depends on S and R only): the padded batch has exactly the
    bucket's shape, the real sequences as they were, and its padding rows in the scratch slot in
    sequences of at most PAD_CHUNK rows, one row per position 0 .. R_b - R - 1."""
    scratch = n_slots
    for shape in bucket_shapes(DEFAULT_GRAPH_ROWS, n_slots):
        for n_seqs in range(min(shape.rows, n_slots) + 1):
            for n_rows in range(n_seqs, shape.rows + 1) if n_seqs else [0]:
                counts = (n_rows - n_seqs + 1,) + (1,) * (n_seqs - 1) if n_seqs else ()
                batch = RowBatch(tuple(range(n_seqs)), tuple(7 * s for s in range(n_seqs)), counts)
                padded = pad_batch(batch, shape, scratch)
                assert (padded.n_rows, len(padded.slots)) == (shape.rows, shape.sequences)
                assert (padded.slots[:n_seqs], padded.starts[:n_seqs], padded.counts[:n_seqs]) == (batch.slots, batch.starts, batch.counts)
                padding = range(n_seqs, shape.sequences)
                assert all(padded.slots[s] == scratch for s in padding)
                assert max((padded.counts[s] for s in padding), default=0) <= PAD_CHUNK, \
                    f"bucket {shape}, {n_rows} rows in {n_seqs} sequences: a padding sequence of {max(padded.counts[n_seqs:])} rows"
                positions = sorted(padded.starts[s] + r for s in padding for r in range(padded.counts[s]))
                assert positions == list(range(shape.rows - n_rows)), f"bucket {shape}: padding positions {positions}"


def test_k_mixes_pad_with_several_padding_sequences():
    """The engine-level test above shares the scratch slot among padding sequences with rows: K mix
    [1, 3, 0] (7 rows) pads to bucket 16 with padding sequences of 8 and 1 rows."""
    shapes = bucket_shapes(BUCKETS, len(PROMPTS))
    batch = RowBatch((0, 1, 2), (3, 5, 2), (2, 4, 1))
    padded = pad_batch(batch, bucket_for(shapes, batch), len(PROMPTS))
    assert padded.counts[3:] == (8, 1) and padded.starts[3:] == (0, 8)
    assert padded.slots[3:] == (len(PROMPTS),) * 2


def test_a_padded_batch_splits_its_walks_for_its_rows_not_its_padding():
    """A batch as it is: its own sequences. Padded to a bucket (captured on padding alone): the fewest
    sequences of WALK_ROWS rows that hold the bucket's rows, so one sequence at K = 8 in the 9- or
    10-row bucket (9 or 10 sequences, mostly padding) gets the conv split an unpadded one gets."""
    exact = RowBatch((0, 1, 2), (3, 5, 2), (2, 4, 1))
    assert walk_sequences(exact) == 3
    for rows, want in ((1, 1), (9, 1), (10, 2), (18, 2), (576, 64)):
        shape = bucket_shapes((rows,), 64)[0]
        padded = pad_batch(RowBatch((), (), ()), shape, 64)
        assert len(padded.slots) == shape.sequences and walk_sequences(padded) == want == -(-rows // WALK_ROWS)
    nine = pad_batch(RowBatch((0,), (3,), (9,)), bucket_shapes((9,), 64)[0], 64)
    assert len(nine.slots) == 9 and conv_runs(nine.n_rows, walk_sequences(nine), 8192) == CONV_MAX_RUNS
    assert conv_runs(nine.n_rows, len(nine.slots), 8192) == 1  # split for its 9 sequences: no split


def test_a_step_of_one_sequence_replays_a_bucket_of_exactly_its_rows():
    """bucket_for over the one list of buckets: one sequence of R <= the one-sequence rows -> (R, 1),
    nothing to pad; past them, or two sequences, the smallest shared bucket that fits, padded; past
    the largest, none (eager)."""
    shapes = bucket_shapes((1, 2, 4, 16), 8)
    every = buckets((1, 2, 4, 16), 8, 9)
    for rows in range(1, 10):
        batch = RowBatch((3,), (7,), (rows,))
        shape = bucket_for(every, batch)
        assert shape == BucketShape(rows, 1) and pad_batch(batch, shape, 8) is batch
    assert bucket_for(every, RowBatch((3,), (7,), (10,))) == bucket_for(shapes, RowBatch((3,), (7,), (10,))) == shapes[-1]
    assert bucket_for(every, RowBatch((3, 4), (7, 2), (2, 1))) == bucket_for(shapes, RowBatch((3, 4), (7, 2), (2, 1))) == BucketShape(4, 4)
    assert bucket_for(every, RowBatch((3,), (7,), (17,))) is None


def test_a_one_sequence_bucket_is_captured_on_one_scratch_sequence():
    """capture_batch: a shared bucket's padding (pad_batch of no rows); a one-sequence bucket's one
    scratch-slot sequence of all its rows, whose walks are split for that one sequence (as its real
    steps', unpadded), where a shared bucket of 10 or more rows is split for two or more."""
    assert capture_batch(BucketShape(16, 4), 8) == pad_batch(RowBatch((), (), ()), BucketShape(16, 4), 8)
    for rows in (1, 9, 17):
        batch = capture_batch(BucketShape(rows, 1), 8)
        assert (batch.slots, batch.starts, batch.counts, batch.scratch_slot) == ((8,), (0,), (rows,), 8)
        assert walk_sequences(batch) == walk_sequences(RowBatch((3,), (7,), (rows,))) == 1


@pytest.mark.parametrize("mode", ROLLBACK_MODES)
def test_a_one_sequence_buckets_capture_touches_no_real_slot(load_target, mode):
    """What a graph's capture runs for a one-sequence bucket (graphs.py: the verify on capture_batch,
    then a rollback keeping nothing), eagerly on the CPU: no real slot's state changes, the scratch
    slot's conv window and recurrent state stay zero, and a real step after it equals one without."""
    model = load_target("qwen3_next_moe")
    engines = [Engine(model, 2, MAX_SEQ_LEN, max_k=MAX_K, rollback_mode=mode, cuda_graphs=False) for _ in range(2)]
    seqs = [e.open([5, 6, 7], SamplingParams(), 10, eos_ids=()) for e in engines]
    engine = engines[1]
    before = [t.clone() for layer in engine.pool.layers for t in layer.named_tensors().values()]
    engine.runner.padding_step(BucketShape(MAX_K + 1, 1))  # capture_batch's step, eagerly: token 0 rows, keeping none
    after = [t for layer in engine.pool.layers for t in layer.named_tensors().values()]
    for a, b in zip(before, after):
        assert torch.equal(a[: engine.pool.n_slots], b[: engine.pool.n_slots]), "the capture's step changed a real slot"
    _assert_scratch_clean(engine)
    want, got = (e.step([StepRequest(s, [1, 2, 3])])[0] for e, s in zip(engines, seqs))
    assert (got.tokens, got.position) == (want.tokens, want.position) and torch.equal(got.logits, want.logits)
