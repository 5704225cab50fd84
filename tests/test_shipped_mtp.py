"""The shipped target's trained MTP head (models/target, models/MODEL_CARD.md): it loads, its drafts
are accepted, and the stream it drafts for is plain decoding's, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from verifier.engine import Engine
from verifier.generate import generate
from verifier.model import load_model
from verifier.model.mtp import load_mtp_head
from verifier.params import SamplingParams
from verifier.proposers import MTPProposer
from verifier.tokenizer import TextTokenizer

TARGET = Path(__file__).resolve().parent.parent / "models" / "target"
pytestmark = pytest.mark.skipif(not (TARGET / "model.safetensors").is_file(), reason="no shipped models/ in this checkout")

PROMPT = "import os\n\n\ndef read_config(path):\n    \"\"\"Return the lines of the file at path.\"\"\"\n"


@pytest.fixture(scope="module")
def shipped():
    model = load_model(TARGET, "cpu", torch.float32)
    head = load_mtp_head(TARGET, model)
    prompt = TextTokenizer.from_model_dir(TARGET).encode(PROMPT)
    engine = Engine(model, n_slots=1, max_seq_len=len(prompt) + 64 + 4, max_k=4)
    return engine, head, prompt


def test_the_shipped_target_carries_one_mtp_layer(shipped):
    _, head, _ = shipped
    assert head is not None and head.n_layers == 1


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.95, seed=7)],
                         ids=["greedy", "seeded"])
def test_its_drafts_are_accepted_and_the_stream_is_plain_decodings(shipped, sampling):
    engine, head, prompt = shipped
    plain = generate(engine, prompt, 64, sampling)
    drafted = generate(engine, prompt, 64, sampling, MTPProposer(head, engine.pool.max_seq_len, sampling), k=4)
    assert drafted.tokens == plain.tokens
    assert torch.equal(drafted.logits, plain.logits)
    # a trained head: well over one token per step (a random one stays near 1.0)
    assert drafted.mean_acceptance_length > 2.0, drafted.mean_acceptance_length


def test_the_acceptance_comparison_counts_as_the_acceptance_bench(tmp_path):
    """python -m training acceptance on the shipped pair (two prompts, a few tokens): both drafters'
    streams equal plain, and its figures are the acceptance bench's from the same steps."""
    import json

    from drafter.bench_stats import count, figures
    from training.acceptance import DEFAULT_PROMPTS, measure

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(DEFAULT_PROMPTS.read_text().splitlines()[:2]) + "\n")
    result = measure(TARGET.parent, prompts, (2,), 12, "cpu")
    assert [(r["drafter"], r["k"]) for r in result["rows"]] == [("model", 2), ("mtp", 2)]
    for row in result["rows"]:
        assert row["streams_match_plain"] and row["mismatched_prompts"] == []
        assert len(row["per_position_acceptance"]) == 2 and row["mean_acceptance_length"] >= 1.0
    assert json.loads(json.dumps(result)) == result  # what the metrics file stores
    # the same pooling as the bench: one step that kept 1 of 2 drafts, one that kept both
    pooled = figures(count([1, 2], [2, 2], 5, 2))
    assert pooled.mean_acceptance_length == 2.5 and pooled.per_position_acceptance == [1.0, 0.5]
