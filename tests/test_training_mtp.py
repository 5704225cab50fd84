"""The MTP head trainer (training/mtp.py, training/mtp_head.py): what it trains is what the engine runs.

The trained module is written into a tiny target checkpoint; the engine's MTPHead loads it and must
compute the trainer's unrolled rows: step 0 over a prompt (catch-up rows) and the recurrent step
1 row. Parity is a tolerance check (fp32 both; the engine's kernels and torch's SDPA sum in other
orders): largest difference within 1e-4 of the largest |value|, the parity tests' bound.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from presets.training import TINY_TARGET
from training.configs import build_model
from training.mtp import MTPTrainConfig, load_target, step_losses, train_head, write_head
from verifier.model import RowBatch, load_model
from verifier.model.mtp import load_mtp_head

VOCAB = 64
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    path = tmp_path_factory.mktemp("mtp_target")
    build_model(TINY_TARGET, VOCAB, 0, seed=3).eval().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def trained(tiny_target):
    target = load_target(tiny_target, "cpu")
    stream = np.random.default_rng(0).integers(0, VOCAB, 4000)
    cfg = MTPTrainConfig(steps=3, seq_len=32, batch_size=4, max_steps=4, log_every=2, eval_every_s=1e9, dev_windows=2)
    head, result = train_head(target, stream, stream[:200], cfg, budget_s=600, device="cpu", seed=0)
    tensors = write_head(tiny_target, head)
    return target, head, result, tensors


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    scale = float(b.abs().max())
    assert float((a - b).abs().max()) <= TOLERANCE * scale, (float((a - b).abs().max()), scale)


def test_the_trainer_records_its_steps_and_keeps_the_best_dev_weights(trained):
    _, _, result, tensors = trained
    assert result.steps == 4 and result.best_step is not None
    assert len(result.best_dev_agreement) == 3 and all(0 <= a <= 1 for a in result.best_dev_agreement)
    assert all(name.startswith("mtp.") for name in tensors)
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.down_proj.weight"} <= set(tensors)


def test_the_checkpoint_gains_the_head_and_its_layer_count(trained, tiny_target):
    assert json.loads((tiny_target / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    model = load_model(tiny_target, device="cpu", dtype=torch.float32)
    head = load_mtp_head(tiny_target, model)
    assert head is not None and head.n_layers == 1
    written = trained[3]
    assert torch.equal(head.w_fc.float(), written["mtp.fc.weight"].float())


def test_the_engine_computes_the_trainers_unrolled_rows(trained, tiny_target):
    target, trainer, _, tensors = trained
    # the trainer in the stored precision's values (the engine reads what was written)
    trainer = trainer.float()
    trainer.load_state_dict({k.removeprefix("mtp."): v.float() for k, v in tensors.items()})
    tokens = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = target.model(input_ids=tokens, use_cache=False).last_hidden_state
        rows = trainer.unrolled(target, tokens, hidden, steps=2)
    model = load_model(tiny_target, device="cpu", dtype=torch.float32)
    head = load_mtp_head(tiny_target, model)
    pool = head.new_pool(1, 64)
    slot = pool.admit()
    n = 20  # catch-up rows q = 0 .. n - 1: (hidden q, token q + 1) at position q
    out, logits = head.forward(tokens[0, 1 : n + 1], hidden[0, :n], RowBatch(slots=(slot,), starts=(0,), counts=(n,)), pool,
                               row_invariant=False)
    _close(out, rows[0][0, :n])
    _close(logits, target.lm_head(rows[0][0, :n]).float())
    # the recurrent row of origin n - 1: (step 0's output there, token n + 1) at position n
    out1, _ = head.forward(tokens[0, n + 1 : n + 2], out[-1:], RowBatch(slots=(slot,), starts=(n,), counts=(1,)), pool,
                           row_invariant=False, step=1)
    _close(out1, rows[1][0, n - 1 : n])


def test_step_losses_score_a_perfect_copy_of_the_teacher_at_its_entropy(trained):
    """The loss is the cross-entropy against the target's softmax: it can fall no lower than the
    teacher's own entropy, and agreement is a fraction."""
    target, head, _, _ = trained
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        loss, agreement = step_losses(head, target, tokens, steps=2, autocast=False)
        teacher = target(input_ids=tokens).logits.float()
        entropy = -(teacher.softmax(-1) * teacher.log_softmax(-1)).sum(-1)  # [2, 16]
        # step s scores teacher rows s + 1 .. 16 - 2 + 1 (origins q with q + s + 1 < 16)
        entropy = torch.stack([entropy[:, s + 1 : s + 1 + 16 - s - 2].mean() for s in range(2)]).mean()
    assert float(loss) >= float(entropy) - 1e-5
    assert len(agreement) == 2 and all(0 <= float(a) <= 1 for a in agreement)


def test_config_rejects_more_steps_than_a_window_holds():
    with pytest.raises(ValueError, match="seq_len"):
        MTPTrainConfig(steps=8, seq_len=8)
