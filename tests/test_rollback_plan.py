"""verifier.model.rollback.RollbackPlan (every recurrent layer in one launch per state,
kernels/fused_rollback.py), the one rollback, on real verify records of every SPECS family (GDN and
KDA layers), both rollback modes: the committed conv windows and recurrent states after rollback
are torch.equal to the per-layer rollback's (`per_layer_rollback`: one launch per layer and state,
the reference kept here, no product path), for kept counts 0 .. K+1 in a batch padded as a graph bucket pads it
(padding sequences sharing the scratch slot keep nothing). One plan serves every kept count, as a
graph bucket's plan serves every step: the pool's tensors are restored in place between them.

Both backends: the Triton launchers (forced onto the CPU tensors under the interpreter, or on the
GPU with --model-device cuda), and the torch references, the CPU backend's path."""

import pytest
import torch

from conftest import ALL_SPECS
from hybrid_kernels import delta_rule, fused_rollback, runtime, short_conv
from hybrid_kernels.runtime import pick
from verifier.model.padding import BucketShape, pad_batch
from verifier.model.rollback import ROLLBACK_MODES, RollbackPlan, VerifyRecord, rollback_named
from verifier.model.rows import RowBatch
from verifier.model.state import RecurrentState
from verifier.model.rows import StepInputs

PROMPTS = [[5, 6, 7, 9], [11, 3, 9, 2, 8]]
DRAFTS = (4, 2)  # K per sequence: the first one keeps 0 .. K+1 rows
# 8 real rows, padded to 12: one padding sequence of 4 rows and an empty one in the scratch slot
SHAPE = BucketShape(rows=12, sequences=4)


def verified(model, mode: str):
    """A pool with PROMPTS prefilled and the record of one padded verify of DRAFTS drafts (random
    tokens: what rollback keeps is set by the kept counts, not by acceptance)."""
    pool = model.new_pool(len(PROMPTS), 32)
    for prompt in PROMPTS:
        model.prefill(pool, pool.admit(), prompt)
    batch = RowBatch(slots=(0, 1), starts=tuple(len(p) for p in PROMPTS), counts=tuple(k + 1 for k in DRAFTS))
    padded = pad_batch(batch, SHAPE, pool.scratch_slot)
    tokens = torch.randint(3, model.config.vocab_size, (batch.n_rows,), generator=torch.Generator().manual_seed(0))
    inputs = StepInputs(padded.n_rows, len(padded.slots), "cpu").fill(tokens, padded).to(model.device)
    padded.attach(model.device, inputs.batch_tensors())
    record = rollback_named(mode).record(padded)
    model.compute(inputs.tokens, padded, pool, row_invariant=True, last_only=False, record=record)
    return pool, record


def per_layer_rollback(pool, record: VerifyRecord, kept: torch.Tensor) -> None:
    """The reference: each recurrent layer's conv window, then its recurrent state (a snapshot copy
    or a fold), one launch each, with the one-layer ops (Triton or torch, as pick chooses)."""
    for index, layer_record in record.layers.items():
        state = pool.layers[index]
        device = state.recurrent.device
        seq_slots, cu_rows = record.batch.seq_slots(device), record.batch.cu_rows(device)
        pick(short_conv.next_window, short_conv.next_window_ref, state.conv)(state.conv, layer_record.conv_inputs, seq_slots, cu_rows, kept)
        if layer_record.snapshots is not None:
            keep = pick(fused_rollback.keep_snapshots, fused_rollback.keep_snapshots_ref, state.recurrent)
            keep(state.recurrent, layer_record.snapshots, seq_slots, cu_rows, kept)
        else:
            fold = pick(delta_rule.delta_rule_fold, delta_rule.delta_rule_fold_ref, state.recurrent)
            fold(state.recurrent, layer_record.keys, layer_record.values, layer_record.decays, layer_record.betas,
                 seq_slots, cu_rows, kept)


def committed(pool) -> list[torch.Tensor]:
    return [t for layer in pool.layers if isinstance(layer, RecurrentState) for t in (layer.conv, layer.recurrent)]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("mode", ROLLBACK_MODES)
@pytest.mark.parametrize("name", ALL_SPECS)
def test_plan_equals_per_layer_rollback(load_target, name, mode, backend, monkeypatch):
    model = load_target(name)
    if backend == "triton" and not (model.embed.is_cuda or runtime.interpreting()):
        pytest.skip("no GPU and TRITON_INTERPRET is not set")
    if backend == "torch" and model.embed.is_cuda:
        pytest.skip("the torch references serve CPU tensors")
    pool, record = verified(model, mode)
    if backend == "triton":
        monkeypatch.setattr(runtime, "use_triton", lambda t: True)  # the rollback's launchers, not the verify's
    state = committed(pool)
    assert state and all(t.any() for t in state[::2]), "prefill left a conv window at zero: a weak test"
    start = [t.clone() for t in state]
    plan = RollbackPlan(pool, record)
    assert len(plan.groups) == 1 and plan.groups[0].n_layers == len(record.layers), "one group of all recurrent layers"
    scratch = pool.scratch_slot
    for first in range(DRAFTS[0] + 2):
        kept = torch.tensor([first, first % (DRAFTS[1] + 2), 0, 0], dtype=torch.int32, device=model.device)
        for t, s in zip(state, start):
            t.copy_(s)
        per_layer_rollback(pool, record, kept)
        want = [t.clone() for t in state]
        for t, s in zip(state, start):
            t.copy_(s)
        plan.apply(kept)
        for i, (got, expected, before) in enumerate(zip(state, want, start)):
            what = f"{name} {mode} {backend}: {'conv window' if i % 2 == 0 else 'recurrent state'} of recurrent layer {i // 2}"
            assert torch.equal(got, expected), f"{what}, kept {kept.tolist()}"
            assert torch.equal(got[scratch], before[scratch]), f"{what}: the scratch slot was written"
            if first > 0:
                assert not torch.equal(got[0], before[0]), f"{what}: slot 0 kept {first} rows and did not change"
