"""Graph-bucket padding at the engine level, on the CPU reference backend: a step padded to its
bucket (the padding code path the CUDA graphs replay, run eagerly) gives every real row and every
real slot's state torch.equal to the unpadded step, for mixed K and both rollback modes; the
scratch slot's conv window and recurrent state stay zero. Also: the bucket list, step_costs, and
steps that want no logits."""

import pytest
import torch

from bitexact.serial import serial_run
from verifier.engine import Engine, StepRequest
from verifier.model.graphs import DEFAULT_GRAPH_ROWS
from verifier.model.rollback import ROLLBACK_MODES
from verifier.model.state import RecurrentState
from verifier.params import SamplingParams

BUCKETS = (2, 4, 8, 16)
MAX_SEQ_LEN, MAX_K = 64, 5
PROMPTS = [[5, 6, 7], [11, 3, 9, 2, 8], [4, 4]]
# drafts per sequence and step: rows 3 (bucket 4: one padding row), 7 (8), 14 (16), 10 (16),
# 18 (past the largest bucket: eager, unpadded), and two sequences of 2 rows each (bucket 4 exactly:
# a padding sequence with no rows and an empty one)
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
            for name in vars(a):
                assert torch.equal(getattr(a, name)[real], getattr(b, name)[real]), f"K {mix}: layer {index} {name}"
        _assert_scratch_clean(engines[1])


def _assert_scratch_clean(engine):
    scratch = engine.pool.scratch_slot
    for layer in engine.pool.layers:
        if isinstance(layer, RecurrentState):
            assert not layer.conv[scratch].any() and not layer.recurrent[scratch].any(), "padding wrote the scratch slot's state"


def test_buckets_fit_the_context(load_target):
    model = load_target("qwen3_next_moe")
    engine = Engine(model, 2, 20)
    assert [s.rows for s in engine.runner.shapes] == [r for r in DEFAULT_GRAPH_ROWS if r <= 20]
    assert [s.sequences for s in engine.runner.shapes][:4] == [1, 2, 3, 3]  # min(rows, n_slots + 1)
    with pytest.raises(ValueError, match="passes max_seq_len 20"):
        Engine(model, 2, 20, graph_rows=(4, 32))
    with pytest.raises(ValueError, match="strictly increasing"):
        Engine(model, 2, 20, graph_rows=(4, 4, 8))


def test_eager_step_costs_touch_no_real_slot(load_target):
    model = load_target("qwen3_next_moe")
    engine = Engine(model, 2, MAX_SEQ_LEN, graph_rows=BUCKETS, cuda_graphs=False)
    engine.warm_up()  # eager: nothing to capture
    assert engine.graph_captures == 0 and engine.max_graph_rows is None
    seq = engine.open([5, 6, 7], SamplingParams(), 10, eos_ids=())
    before = [t.clone() for layer in engine.pool.layers for t in vars(layer).values()]
    costs = engine.step_costs()
    assert 1 <= len(costs) and list(costs) == list(BUCKETS[: len(costs)])
    assert all(isinstance(t, float) and t > 0 for t in costs.values())
    after = [t for layer in engine.pool.layers for t in vars(layer).values()]
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
