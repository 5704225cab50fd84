"""CUDA graphs of verify and rollback (GPU only: graphs need CUDA; skipped without a GPU)."""

import pytest
import torch

from verifier.engine import Engine, StepRequest
from verifier.generate import generate
from verifier.params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@pytest.fixture(scope="module")
def model(hf_checkpoint):
    from verifier.model import load_model

    return load_model(hf_checkpoint("qwen3_5_text"), "cuda")


def test_bucket_cache_is_bounded_and_evicted_buckets_recapture(model):
    """Steps with K = 0..4 need five buckets; with room for two, graphs are evicted and recaptured,
    and the stream still equals the plain eager stream bit for bit."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    plain = generate(Engine(model, 1, 64, max_k=0, cuda_graphs=False), prompt, 24)
    engine = Engine(model, 1, 64, max_k=4)
    engine.runner.graphs.max_buckets = 2
    seq = engine.open(prompt, SamplingParams(), 24, eos_ids=())
    tokens, rows, k = [seq.pending], [seq.first_logits[None]], 0
    while not seq.finished:
        drafts = plain.tokens[len(tokens) : len(tokens) + k % 5]  # right drafts, K cycling 0..4
        (result,) = engine.step([StepRequest(seq, drafts[: 64 - seq.position - 1])])
        tokens += result.tokens
        rows.append(result.logits)
        k += 1
        assert len(engine.runner.graphs._buckets) <= 2
    assert tokens == plain.tokens
    assert torch.equal(torch.cat(rows).cpu(), plain.logits.cpu())
