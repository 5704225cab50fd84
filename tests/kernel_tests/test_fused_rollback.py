"""kernels/fused_rollback.py: the rollback of several recurrent layers in one launch per state gives,
layer by layer, torch.equal what the one-layer launchers give (short_conv.next_window,
delta_rule.delta_rule_fold, fused_rollback.keep_snapshots), for GDN and KDA decays, fp32 and bf16 conv
windows, kept counts 0 .. K+1 in a padded batch (padding sequences sharing the scratch slot keep
nothing and write nothing; a one-row sequence's state, which its verify committed, is left alone), records whose rows are strided (as a layer's conv inputs are: a
column block of its input projection's output). The references agree: exactly for the copies,
to fp32 rounding for the fold (tolerance of test_delta_rule.py). One table serves many steps
when the tensors keep their addresses (a graph bucket's use).

On the GPU this is the bit-exactness check of the fused fold against delta_rule_fold; under the
interpreter it checks indexing, masks and the table."""

import pytest
import torch

from hybrid_kernels import fused_rollback
from hybrid_kernels.delta_rule import delta_rule_fold, delta_rule_verify
from hybrid_kernels.fused_rollback import RecurrentLayers, fold_states, keep_state_snapshots, next_windows
from hybrid_kernels.short_conv import next_window
from hybrid_kernels.fused_rollback import keep_snapshots

from . import test_delta_rule as delta
from .conftest import assert_close

N_LAYERS, N_SLOTS, CHANNELS, WIDTH = 3, 6, 37, 4
SCRATCH = N_SLOTS - 1
K = 4  # drafts of the first sequence: its kept count runs 0 .. K + 1
# the real step (rows per sequence, slots), then padding sequences in the scratch slot: two with
# rows (PAD_CHUNK-like chunks) and an empty one
COUNTS = [K + 1, 1, 3] + [2, 1, 0]
SLOTS = [3, 0, 2] + [SCRATCH] * 3
SHAPES = [(3, 6, 10), (2, 16, 40)]  # (H, D_K, D_V): odd sizes; two value blocks
CONV_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def strided_rows(x: torch.Tensor, pad: int = 5) -> torch.Tensor:
    """x [rows, ...] copied into a wider buffer: rows `pad` elements further apart than dense, each row dense."""
    inner = x[0].numel()
    wide = torch.full((x.shape[0], inner + pad), float("nan"), dtype=x.dtype, device=x.device)
    wide[:, 1 : 1 + inner] = x.flatten(1)
    return wide[:, 1 : 1 + inner].unflatten(1, x.shape[1:])


def make_layers(kind: str, shape, conv_dtype, device, seed: int = 0, with_snapshots: bool = True) -> dict[str, list]:
    """Per layer: committed windows and states (the scratch slot's zero), and a record of sum(COUNTS)
    rows with strided rows; keys l2-normalised, decay in (0.5, 1), beta in (0, 1) as in the models."""
    heads, d_k, d_v = shape
    rows, decay_k = sum(COUNTS), 1 if kind == "gdn" else d_k
    g = torch.Generator().manual_seed(seed)
    t: dict[str, list] = {name: [] for name in ("windows", "states", "conv_inputs", "keys", "values", "decays", "betas", "snapshots")}
    for _ in range(N_LAYERS):
        window = torch.randn(N_SLOTS, CHANNELS, WIDTH - 1, generator=g)
        state = torch.randn(N_SLOTS, heads, d_k, d_v, generator=g)
        window[SCRATCH], state[SCRATCH] = 0, 0
        key = torch.randn(rows, heads, d_k, generator=g)
        record = dict(conv_inputs=torch.randn(rows, CHANNELS, generator=g).to(conv_dtype),
                      keys=key / key.norm(dim=-1, keepdim=True), values=torch.randn(rows, heads, d_v, generator=g),
                      decays=torch.rand(rows, heads, decay_k, generator=g) * 0.5 + 0.5, betas=torch.rand(rows, heads, generator=g))
        t["windows"].append(window.to(device, conv_dtype))
        t["states"].append(state.to(device))
        for name, x in record.items():
            t[name].append(strided_rows(x.to(device)))
        t["snapshots"].append(torch.randn(rows, heads, d_k, d_v, generator=g).to(device))
    if not with_snapshots:
        t["snapshots"] = None
    return t


def kept_counts(first: int, device) -> torch.Tensor:
    """The first sequence keeps `first` rows, the others some of theirs, padding sequences none."""
    return torch.tensor([first, 1, 2] + [0, 0, 0], dtype=torch.int32, device=device)


def per_layer(t: dict, seq_slots, cu_rows, kept, snapshot_mode: bool) -> None:
    """Today's rollback: the one-layer launchers, one layer after another."""
    for l in range(N_LAYERS):
        next_window(t["windows"][l], t["conv_inputs"][l], seq_slots, cu_rows, kept)
        if snapshot_mode:
            keep_snapshots(t["states"][l], t["snapshots"][l], seq_slots, cu_rows, kept)
        else:
            delta_rule_fold(t["states"][l], t["keys"][l], t["values"][l], t["decays"][l], t["betas"][l], seq_slots, cu_rows, kept)


def fused(layers: RecurrentLayers, seq_slots, cu_rows, kept, snapshot_mode: bool) -> None:
    next_windows(layers, seq_slots, cu_rows, kept)
    (keep_state_snapshots if snapshot_mode else fold_states)(layers, seq_slots, cu_rows, kept)


def as_layers(t: dict) -> RecurrentLayers:
    return RecurrentLayers(t["windows"], t["states"], t["conv_inputs"], t["keys"], t["values"], t["decays"], t["betas"],
                           t["snapshots"])


def copy_of(t: dict) -> dict:
    """The committed tensors cloned, the record shared."""
    return dict(t, windows=[w.clone() for w in t["windows"]], states=[s.clone() for s in t["states"]])


@pytest.mark.parametrize("window_block_c", [None, 16], ids=["one-window-block", "window-blocks-of-16"])
@pytest.mark.parametrize("snapshot_mode", [False, True], ids=["woa", "snapshot"])
@pytest.mark.parametrize("kind, conv_dtype", [("gdn", torch.bfloat16), ("kda", torch.float32)], ids=["gdn-bf16", "kda-fp32"])
def test_fused_equals_per_layer(kind, conv_dtype, snapshot_mode, window_block_c, device, monkeypatch):
    """Every layer's windows and states bitwise the one-layer launchers', for each kept count
    0 .. K+1 of the first sequence, through one table made once (the tensors keep their
    addresses from step to step: restored in place); slots outside the step and the scratch
    slot are untouched. With next_windows' channel block cut to 16, its CHANNELS = 37 take three
    programs a layer (the last one masked), as the model's 8192 take four."""
    if window_block_c is not None:
        monkeypatch.setattr(fused_rollback, "WINDOW_BLOCK_C", window_block_c)
    t = make_layers(kind, SHAPES[0], conv_dtype, device)
    ours, theirs = copy_of(t), copy_of(t)
    layers = as_layers(ours)
    seq_slots, cu_rows = delta.ragged(COUNTS, SLOTS, device)
    for first in range(K + 2):
        for name in ("windows", "states"):
            for mine, other, start in zip(ours[name], theirs[name], t[name]):
                mine.copy_(start), other.copy_(start)
        kept = kept_counts(first, device)
        per_layer(theirs, seq_slots, cu_rows, kept, snapshot_mode)
        fused(layers, seq_slots, cu_rows, kept, snapshot_mode)
        for name in ("windows", "states"):
            for l, (got, want, start) in enumerate(zip(ours[name], theirs[name], t[name])):
                assert torch.equal(got, want), f"{name}[{l}], first sequence keeping {first}"
                assert torch.equal(got[1], start[1]) and torch.equal(got[SCRATCH], start[SCRATCH]), \
                    f"{name}[{l}]: a slot outside the step, or the scratch slot, was written"
                if first == 0:
                    assert torch.equal(got[3], start[3]), f"{name}[{l}]: a sequence keeping nothing was written"
                # slot 0's one row was committed by its verify (kernels/one_row_commit.py)
                assert torch.equal(got[0], start[0]), f"{name}[{l}]: a one-row sequence's slot was rolled back"


@pytest.mark.parametrize("shape", SHAPES, ids=delta.shape_id)
@pytest.mark.parametrize("kind", delta.KINDS)
def test_fused_matches_ref(kind, shape, device):
    """The references (the one-layer references on each layer): windows and snapshots exactly,
    the fold to fp32 rounding."""
    t = make_layers(kind, shape, torch.float32, device, seed=1)
    seq_slots, cu_rows = delta.ragged(COUNTS, SLOTS, device)
    kept = kept_counts(K + 1, device)
    for snapshot_mode in (False, True):
        ours, ref = copy_of(t), copy_of(t)
        fused(as_layers(ours), seq_slots, cu_rows, kept, snapshot_mode)
        ref_layers = as_layers(ref)
        fused_rollback.next_windows_ref(ref_layers, seq_slots, cu_rows, kept)
        states_ref = fused_rollback.keep_state_snapshots_ref if snapshot_mode else fused_rollback.fold_states_ref
        states_ref(ref_layers, seq_slots, cu_rows, kept)
        for l in range(N_LAYERS):
            assert torch.equal(ours["windows"][l], ref["windows"][l]), f"windows[{l}]"
            if snapshot_mode:
                assert torch.equal(ours["states"][l], ref["states"][l]), f"states[{l}], snapshot mode"
            else:
                assert_close(f"states[{l}] {kind}", ours["states"][l], ref["states"][l], delta.RTOL, delta.ATOL)


@pytest.mark.parametrize("kind", delta.KINDS)
def test_fused_fold_of_k_rows_equals_k_steps_of_one(kind, device):
    """The recurrent contract through the fused fold: the first sequence's K+1 rows folded at
    once give the state that K+1 one-row steps reach, bitwise. A one-row step commits its row in
    its verify (delta_rule_verify) and its fold, through a table of its own, leaves the state."""
    t = make_layers(kind, SHAPES[0], torch.float32, device, seed=2, with_snapshots=False)
    seq_slots, cu_rows = delta.ragged(COUNTS, SLOTS, device)
    whole, stepped = copy_of(t), copy_of(t)
    fold_states(as_layers(whole), seq_slots, cu_rows, kept_counts(K + 1, device))
    one_slots, one_cu = delta.ragged([1], [SLOTS[0]], device)
    for r in range(K + 1):
        row = slice(r, r + 1)  # the first sequence's row r alone
        one = dict(stepped, conv_inputs=[x[row] for x in t["conv_inputs"]], keys=[x[row] for x in t["keys"]],
                   values=[x[row] for x in t["values"]], decays=[x[row] for x in t["decays"]], betas=[x[row] for x in t["betas"]])
        before = [state.clone() for state in stepped["states"]]
        fold_states(as_layers(one), one_slots, one_cu, torch.ones(1, dtype=torch.int32, device=device))
        assert all(torch.equal(a, b) for a, b in zip(before, stepped["states"])), "a one-row sequence was folded"
        for l in range(N_LAYERS):  # the verify's commit (queries: any; its outputs are not looked at)
            delta_rule_verify(stepped["states"][l], one["keys"][l].contiguous(), one["keys"][l].contiguous(),
                              one["values"][l].contiguous(), one["decays"][l].contiguous(), one["betas"][l].contiguous(),
                              one_slots, one_cu)
    for l in range(N_LAYERS):
        assert torch.equal(whole["states"][l][SLOTS[0]], stepped["states"][l][SLOTS[0]]), f"states[{l}]"


def test_layers_reject_bad_tensors(device):
    t = make_layers("gdn", SHAPES[0], torch.float32, device)
    with pytest.raises(ValueError, match="keys has 2 tensors"):
        RecurrentLayers(**dict(t, keys=t["keys"][:2]))
    with pytest.raises(ValueError, match=r"values\[1\] must be dense within a row"):
        transposed = t["values"][1].transpose(1, 2).contiguous().transpose(1, 2)  # [R, H, D_V], heads innermost
        RecurrentLayers(**dict(t, values=[t["values"][0], transposed, t["values"][2]]))
    with pytest.raises(ValueError, match=r"conv_inputs\[0\] dtype"):
        RecurrentLayers(**dict(t, conv_inputs=[x.to(torch.bfloat16) for x in t["conv_inputs"]]))
    with pytest.raises(ValueError, match=r"windows\[2\] must be contiguous"):
        RecurrentLayers(**dict(t, windows=t["windows"][:2] + [t["windows"][2].transpose(1, 2).contiguous().transpose(1, 2)]))
    with pytest.raises(ValueError, match="snapshots"):
        RecurrentLayers(**dict(t, snapshots=[s[:, :, :, :-1] for s in t["snapshots"]]))
    layers = as_layers(t)
    seq_slots, cu_rows = delta.ragged(COUNTS, SLOTS, device)
    with pytest.raises(ValueError, match="kept dtype"):
        fold_states(layers, seq_slots, cu_rows, kept_counts(1, device).long())
    no_snapshots = as_layers(dict(t, snapshots=None))
    with pytest.raises(ValueError, match="no snapshots"):
        keep_state_snapshots(no_snapshots, seq_slots, cu_rows, kept_counts(1, device))


def test_table_from_a_store_is_written_by_fill_table(device):
    """Layers made with a TableStore (inside a graph capture) take its next rows and write nothing
    until fill_table; then the rows equal the table made at once (the same tensors), a launch
    through them rolls back as per layer, and a store refuses more rows than it holds."""
    t = make_layers("gdn", SHAPES[0], torch.bfloat16, device)
    store = fused_rollback.TableStore(N_LAYERS + 1, torch.device(device))  # 2 * (N_LAYERS + 1) = 8 rows
    store.buffer.fill_(-1)  # what a capture leaves there: anything
    ours = copy_of(t)
    first = RecurrentLayers(ours["windows"], ours["states"], ours["conv_inputs"], ours["keys"], ours["values"],
                            ours["decays"], ours["betas"], store=store)
    second = RecurrentLayers(ours["windows"], ours["states"], ours["conv_inputs"], ours["keys"], ours["values"],
                             ours["decays"], ours["betas"], store=store)
    # the second starts at the next aligned row: 4, past the first's rows 0 .. 2
    assert first.table.data_ptr() == store.buffer.data_ptr() and second.table.data_ptr() == store.buffer[N_LAYERS + 1].data_ptr()
    assert second.table.data_ptr() % 16 == 0
    assert (store.buffer == -1).all(), "a table from a store is written by fill_table only"
    first.fill_table()
    at_once = RecurrentLayers(ours["windows"], ours["states"], ours["conv_inputs"], ours["keys"], ours["values"],
                              ours["decays"], ours["betas"])
    assert torch.equal(first.table, at_once.table)
    assert (second.table == -1).all()
    theirs = copy_of(t)
    seq_slots, cu_rows = delta.ragged(COUNTS, SLOTS, device)
    kept = kept_counts(K + 1, device)
    per_layer(theirs, seq_slots, cu_rows, kept, False)
    fused(first, seq_slots, cu_rows, kept, False)
    for name in ("windows", "states"):
        for l, (got, want) in enumerate(zip(ours[name], theirs[name])):
            assert torch.equal(got, want), f"{name}[{l}] through the store's table"
    with pytest.raises(ValueError, match="TableStore: 3 more layers' rows asked with 0 left"):
        as_store = dict(ours, store=store)
        RecurrentLayers(**{k: v for k, v in as_store.items() if k != "snapshots"})
