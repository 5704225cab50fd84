"""CUDA graph buckets of verify and rollback (GPU only: graphs need CUDA; skipped without a GPU).

After warm_up, serving captures nothing whatever the mix of K: every step replays its bucket,
padded (a step of one sequence its own bucket, exactly its rows); every logits row, token and
real slot's state equals the eager engine's bitwise; graph memory stays flat; buckets captured
without PDL (past graphs.PDL_MAX_ROWS) give the bits of the eager engine's launches with it. The
padding itself is tested on the CPU (tests/test_padded_steps.py, tests/kernel_tests/test_padded_batches.py)."""

import random

import pytest
import torch

from verifier.engine import Engine, StepRequest
from verifier.model import graphs
from verifier.model.graphs import DEFAULT_GRAPH_ROWS
from verifier.model.rollback import ROLLBACK_MODES
from verifier.params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")]

N_SLOTS, MAX_SEQ_LEN, MAX_K = 6, 512, 6
# 25 .. 39 rows pad to 40 with 1 .. 15 padding rows: up to two padding sequences with rows share the
# scratch slot (padding.PAD_CHUNK = 8); 6 sessions at K = 6 is 42 rows: past the largest, eager
GRAPH_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 40)
# besides them one bucket for each one-sequence step of 2 .. MAX_K + 1 rows (1 row is bucket (1, 1) already)
BUCKETS = len(GRAPH_ROWS) + MAX_K


@pytest.fixture(scope="module")
def model(hf_checkpoint):
    from verifier.model import load_model

    return load_model(hf_checkpoint("qwen3_5_text"), "cuda")


def _open_all(engine, rng):
    return [engine.open([rng.randrange(3, 90) for _ in range(rng.randrange(2, 9))], SamplingParams(), 10_000, eos_ids=())
            for _ in range(N_SLOTS)]


@pytest.mark.parametrize("pdl_max_rows", [graphs.PDL_MAX_ROWS, 8], ids=["default", "buckets-past-8-rows-without-pdl"])
@pytest.mark.parametrize("mode", ROLLBACK_MODES)
def test_warm_engine_captures_nothing_and_matches_eager(model, mode, pdl_max_rows, monkeypatch):
    """200 steps of random K mixes (random subsets of the sessions, drafts right and wrong): no
    capture after warm_up, logits, tokens and every real slot's state bitwise the eager engine's;
    a step's returned logits outlive the next step's replay; the hidden rows a step asks for are
    the eager engine's, bitwise, with no capture of their own. With the PDL limit cut to 8 rows the
    buckets of 12 to 40 rows are captured without PDL while the eager engine launches with it (on
    Hopper)."""
    monkeypatch.setattr(graphs, "PDL_MAX_ROWS", pdl_max_rows)
    graphed = Engine(model, N_SLOTS, MAX_SEQ_LEN, max_k=MAX_K, rollback_mode=mode, graph_rows=GRAPH_ROWS)
    eager = Engine(model, N_SLOTS, MAX_SEQ_LEN, max_k=MAX_K, rollback_mode=mode, cuda_graphs=False)
    graphed.warm_up()
    captures = graphed.graph_captures
    assert captures == BUCKETS and graphed.runner.max_graph_rows == GRAPH_ROWS[-1]
    rng_g, rng_e = random.Random(0), random.Random(0)
    pairs = list(zip(_open_all(graphed, rng_g), _open_all(eager, rng_e)))
    rng = random.Random(1)
    earlier = []  # the last step's returned logits with a copy: the graph's next replay must not reach them
    for step in range(200):
        live = [p for p in pairs if p[0].position + MAX_K + 1 < MAX_SEQ_LEN and rng.random() < 0.8] or pairs[:1]
        drafts = []
        for g, _ in live:
            k = rng.randrange(0, MAX_K + 1)
            # the pending token repeated is right now and then for these tiny models; random ones are wrong
            drafts.append([g.pending if rng.random() < 0.5 else rng.randrange(90) for _ in range(k)])
        hidden = step % 2 == 0  # every other step hands its hidden rows over (an MTP head's input)
        got = graphed.step([StepRequest(g, d, want_hidden=hidden) for (g, _), d in zip(live, drafts)])
        want = eager.step([StepRequest(e, d, want_hidden=hidden) for (_, e), d in zip(live, drafts)])
        for a, b in zip(got, want):
            assert a.error is None and b.error is None
            assert (a.tokens, a.accepted, a.position) == (b.tokens, b.accepted, b.position), f"step {step}"
            assert torch.equal(a.logits, b.logits), f"step {step}: logits differ"
            if hidden:
                assert a.hidden.shape == (len(a.tokens), model.config.hidden_size)
                assert torch.equal(a.hidden, b.hidden), f"step {step}: hidden rows differ"
        assert all(torch.equal(rows, copy) for rows, copy in earlier), f"step {step} changed the last step's logits"
        earlier = [(a.logits, a.logits.clone()) for a in got]
    assert graphed.graph_captures == captures, "a step captured a graph while serving"
    real = slice(0, N_SLOTS)
    assert graphed.pool.carried == eager.pool.carried
    for index, (a, b) in enumerate(zip(graphed.pool.layers, eager.pool.layers)):
        others = b.named_tensors()
        for name, t in a.named_tensors().items():
            assert torch.equal(t[real], others[name][real]), f"layer {index} {name}"


def test_graph_memory_is_flat_while_serving(model):
    engine = Engine(model, N_SLOTS, MAX_SEQ_LEN, max_k=MAX_K, graph_rows=GRAPH_ROWS)
    engine.warm_up()
    rng = random.Random(2)
    seqs = _open_all(engine, rng)

    def steps(n):
        for _ in range(n):
            live = [s for s in seqs if s.position + MAX_K + 1 < MAX_SEQ_LEN] or seqs[:1]
            k = [rng.randrange(0, MAX_K // 2) for _ in live]  # at most 18 rows: every step graphed
            engine.step([StepRequest(s, [rng.randrange(90) for _ in range(n_k)], want_logits=False) for s, n_k in zip(live, k)])

    steps(5)
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    steps(100)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated and torch.cuda.memory_reserved() == reserved
    assert engine.graph_captures == BUCKETS


def test_step_costs_cover_every_bucket(model):
    engine = Engine(model, N_SLOTS, MAX_SEQ_LEN, max_k=MAX_K, graph_rows=GRAPH_ROWS)
    engine.warm_up()
    costs = engine.step_costs()
    assert list(costs) == list(GRAPH_ROWS) and all(t > 0 for t in costs.values())
    assert engine.graph_captures == BUCKETS


def test_default_buckets_capture_at_startup(model):
    engine = Engine(model, 64, 1024)  # max_k 8: one-sequence buckets of 2 .. 9 rows besides the shared ones
    engine.warm_up()
    assert engine.graph_captures == len(DEFAULT_GRAPH_ROWS) + 8 and engine.runner.max_graph_rows == DEFAULT_GRAPH_ROWS[-1]


def test_the_verify_graphs_ids_are_the_argmax_of_its_logits(model):
    """A graphed verify ends with each row's argmax copied to the host (graphs.py, Greedy ids): for
    a bucket the step fits exactly and for padded ones, the ids of its rows are argmax_rows of the
    logits it hands back."""
    from hybrid_kernels.sampling import argmax_rows
    from verifier.model.rows import RowBatch

    engine = Engine(model, N_SLOTS, MAX_SEQ_LEN, max_k=MAX_K, graph_rows=GRAPH_ROWS)
    engine.warm_up()
    seqs = _open_all(engine, random.Random(3))
    positions = {s.slot: s.position for s in seqs}
    rng = random.Random(4)
    for n_seqs, k in ((1, 0), (1, 3), (3, 6), (5, 4)):  # 1 and 4 rows fit their buckets; 21 and 25 rows pad to 24 and 40
        chosen = seqs[:n_seqs]
        batch = RowBatch(tuple(s.slot for s in chosen), tuple(positions[s.slot] for s in chosen), (k + 1,) * n_seqs)
        tokens = [rng.randrange(3, 90) for _ in range(batch.n_rows)]
        step = engine.runner.step(tokens, batch)
        logits = step.verify()
        assert step.greedy_ids is not None, "a graphed verify hands back its ids"
        assert step.greedy_ids(batch.n_rows) == argmax_rows(logits).tolist(), (n_seqs, k)
        step.rollback([1] * n_seqs)  # each keeps its first row
        for s in chosen:
            positions[s.slot] += 1
