"""Rollback of every recurrent layer of a step in one launch per state: the conv windows of all
layers in one (`next_windows`), the recurrent states of all layers in another (`fold_states`,
write-on-accept; `keep_carry`, write-on-accept in a pool that carries its kept rows into the next
verify, verifier/model/rollback.py; `keep_state_snapshots`, snapshot mode). Per layer each gives what its one-layer
kin gives, bit for bit: short_conv.next_window, delta_rule.delta_rule_fold, keep_snapshots (One layer's snapshot
copy, below).
The design in full: DESIGN.md section 6, "The fused rollback".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import delta_rule, short_conv
from .checks import check_contiguous, check_launchable, check_ragged, check_tensor
from .delta_rule import state_tile, walk_rows
from .dependent_launch import after_previous, launch_options
from .one_row_commit import rows_to_roll
from .rounding import TL_DTYPES
from .runtime import interpreting
from .short_conv import shift_window

# The copies' programs: a few large ones per (sequence, layer), not one per head or per 256 channels.
# A rollback's copies are kilobytes; what they cost is programs, each a chain of dependent loads (the
# counts, the table, the data). At 64 sequences x 9 rows of the 2B model (the 576-row bucket: 136
# sequences, 18 layers) one program per head and per 256 channels made 78k programs each for
# keep_carry and next_windows, each slower than the copy it does (bench.gpu times the steps).
CARRY_BLOCK, CARRY_NUM_WARPS = 1024, 4  # values of a row's tensor per program: a 32 x 128 key row is 4 programs
# Sequences x row programs up to which keep_carry deals a sequence's rows to programs of their own
# (carry_row_programs): a batch-1 bucket of 9 sequences (one real) gets a program per row.
CARRY_SEQUENCE_PROGRAMS = 128
WINDOW_BLOCK_C = 2048  # channels per next_windows program (4 warps): a conv dim of 8192 is 4 programs

# The pointer table's columns, per layer: tensors by address, a record's rows by their stride in elements.
FIELDS = ("window", "conv_inputs", "conv_inputs_row_stride", "state", "key", "key_row_stride", "value", "value_row_stride",
          "decay", "decay_row_stride", "beta", "beta_row_stride", "snapshots", "carry_key", "carry_value", "carry_decay",
          "carry_beta")
N_FIELDS = tl.constexpr(len(FIELDS))
_ALIGNED_ROWS = 2  # table rows of 17 int64 (136 bytes): every second row starts 16-byte aligned (272 = 17 * 16)
WINDOW, CONV_INPUTS, CONV_INPUTS_ROW_STRIDE, STATE = (tl.constexpr(FIELDS.index(f)) for f in FIELDS[:4])
KEY, KEY_ROW_STRIDE, VALUE, VALUE_ROW_STRIDE = (tl.constexpr(FIELDS.index(f)) for f in FIELDS[4:8])
DECAY, DECAY_ROW_STRIDE, BETA, BETA_ROW_STRIDE, SNAPSHOTS = (tl.constexpr(FIELDS.index(f)) for f in FIELDS[8:13])
CARRY_FIELDS = FIELDS[13:]  # in CarriedRows' order: keys, values, decays, betas
CARRY_KEY, CARRY_VALUE, CARRY_DECAY, CARRY_BETA = (tl.constexpr(FIELDS.index(f)) for f in CARRY_FIELDS)


SNAPSHOT_BLOCK = 1024  # fp32 values per program of a snapshot copy: a 128 x 128 head is 16 programs
SNAPSHOT_NUM_WARPS = 4


@triton.jit
def _copy_head_block(src, dst, i_b, HEAD: tl.constexpr, BLOCK: tl.constexpr):
    """Block i_b of one head's HEAD = D_K * D_V values from src to dst (both at the head's first value)."""
    o_x = i_b * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] within the head
    m_x = o_x < HEAD
    tl.store(dst + o_x, tl.load(src + o_x, mask=m_x), mask=m_x)


@triton.jit
def _keep_snapshots_kernel(state, snapshots, seq_slots, cu_rows, kept, HEAD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    after_previous(PDL)  # first: kernels/dependent_launch.py
    i_s = tl.program_id(0)
    i_h = tl.program_id(1)  # a head of the slot
    i_b = tl.program_id(2)  # a block of that head's D_K * D_V values
    i_kept = rows_to_roll(cu_rows, kept, i_s)
    if i_kept == 0:  # padding, or one row, which its verify committed
        return
    i_slot = tl.load(seq_slots + i_s).to(tl.int64)
    i_row = (tl.load(cu_rows + i_s) + i_kept - 1).to(tl.int64)
    n_heads = tl.num_programs(1)
    _copy_head_block(snapshots + (i_row * n_heads + i_h) * HEAD, state + (i_slot * n_heads + i_h) * HEAD, i_b, HEAD, BLOCK)


def _check_snapshots(op: str, state: torch.Tensor, snapshots: torch.Tensor, seq_slots: torch.Tensor, cu_rows: torch.Tensor,
           kept: torch.Tensor) -> None:
    if state.dim() != 4 or state.dtype != torch.float32:
        raise ValueError(f"{op}: state must be fp32 [n_slots, H, D_K, D_V], got {state.dtype} {list(state.shape)}")
    on_state = ("state", state)
    if snapshots.dim() != 4:
        raise ValueError(f"{op}: snapshots must be 4-D [R, H, D_K, D_V], got shape {list(snapshots.shape)}")
    check_tensor(op, "snapshots", snapshots, (snapshots.shape[0], *state.shape[1:]), torch.float32, on_state,
                 layout="[R, H, D_K, D_V]", contiguous=True)
    check_ragged(op, seq_slots, cu_rows, on_state)
    check_tensor(op, "kept", kept, seq_slots.shape, torch.int32, on_state, layout="[S]")


def keep_snapshots(state: torch.Tensor, snapshots: torch.Tensor, seq_slots: torch.Tensor, cu_rows: torch.Tensor,
                   kept: torch.Tensor) -> None:
    """In place: state[seq_slots[s]] = snapshots[cu_rows[s] + kept[s] - 1] where kept[s] > 0 and s
    has more than one row. kept[s] in 0 .. rows of s is not checked (that would sync)."""
    op = "keep_snapshots"
    _check_snapshots(op, state, snapshots, seq_slots, cu_rows, kept)
    check_launchable(op, "state", state)
    check_contiguous(op, "state", state)
    n_seqs, heads = seq_slots.shape[0], state.shape[1]
    head = state.shape[2] * state.shape[3]
    if n_seqs == 0 or snapshots.shape[0] == 0:
        return
    _keep_snapshots_kernel[(n_seqs, heads, triton.cdiv(head, SNAPSHOT_BLOCK))](
        state, snapshots, seq_slots, cu_rows, kept, HEAD=head, BLOCK=SNAPSHOT_BLOCK, num_warps=SNAPSHOT_NUM_WARPS, **launch_options(state.device),
    )


def keep_snapshots_ref(state: torch.Tensor, snapshots: torch.Tensor, seq_slots: torch.Tensor, cu_rows: torch.Tensor,
                       kept: torch.Tensor) -> None:
    """keep_snapshots in torch, one sequence at a time: the CPU reference backend's snapshot rollback."""
    _check_snapshots("keep_snapshots_ref", state, snapshots, seq_slots, cu_rows, kept)
    bounds = cu_rows.tolist()
    for s, (slot, n) in enumerate(zip(seq_slots.tolist(), kept.tolist())):
        if n > 0 and bounds[s + 1] - bounds[s] > 1:
            state[slot] = snapshots[bounds[s] + n - 1]


@triton.jit
def _field(table, i_layer, FIELD: tl.constexpr):
    """Layer i_layer's int64 entry FIELD of the table."""
    return tl.load(table + i_layer * N_FIELDS + FIELD)


@triton.jit
def _pointer(table, i_layer, FIELD: tl.constexpr, DTYPE: tl.constexpr):
    """Layer i_layer's address FIELD as a pointer to DTYPE."""
    return _field(table, i_layer, FIELD).to(tl.pointer_type(DTYPE))


@triton.jit
def _next_windows_kernel(
    table, seq_slots, cu_rows, kept,
    C: tl.constexpr,
    W: tl.constexpr,
    CONV_DTYPE: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_W: tl.constexpr,
    C_BLOCKS: tl.constexpr,  # cdiv(C, BLOCK_C): programs per layer and sequence
    PDL: tl.constexpr,
):
    after_previous(PDL)  # first: kernels/dependent_launch.py
    i_s = tl.program_id(0)
    i_layer = tl.program_id(1) // C_BLOCKS
    i_c = tl.program_id(1) % C_BLOCKS
    i_n = rows_to_roll(cu_rows, kept, i_s).to(tl.int64)
    if i_n == 0:
        # a padding sequence (graph buckets), or one row, which conv_rows committed: not read nor written
        return
    i_slot = tl.load(seq_slots + i_s).to(tl.int64)
    i_bos = tl.load(cu_rows + i_s).to(tl.int64)
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C] channels
    window = _pointer(table, i_layer, WINDOW, CONV_DTYPE)
    inputs = _pointer(table, i_layer, CONV_INPUTS, CONV_DTYPE)
    i_row_stride = _field(table, i_layer, CONV_INPUTS_ROW_STRIDE)
    shift_window(window, inputs, i_row_stride, i_slot, i_bos, i_n, o_c, o_c < C, C, W, BLOCK_W)


@triton.jit
def _stash_of_head(table, i_layer, i_h, D_K: tl.constexpr, D_V: tl.constexpr, DECAY_K: tl.constexpr):
    """Layer i_layer's record for head i_h: key, value, decay, beta pointers at row 0's first channel
    of that head, and their row strides in elements."""
    key = _pointer(table, i_layer, KEY, tl.float32) + i_h * D_K
    value = _pointer(table, i_layer, VALUE, tl.float32) + i_h * D_V
    decay = _pointer(table, i_layer, DECAY, tl.float32) + i_h * DECAY_K
    beta = _pointer(table, i_layer, BETA, tl.float32) + i_h
    s_key = _field(table, i_layer, KEY_ROW_STRIDE)
    s_value = _field(table, i_layer, VALUE_ROW_STRIDE)
    s_decay = _field(table, i_layer, DECAY_ROW_STRIDE)
    s_beta = _field(table, i_layer, BETA_ROW_STRIDE)
    return key, value, decay, beta, s_key, s_value, s_decay, s_beta


@triton.jit
def _fold_states_kernel(table, seq_slots, cu_rows, kept, H: tl.constexpr, D_K: tl.constexpr, D_V: tl.constexpr,
                        DECAY_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr):
    after_previous(PDL)  # first: kernels/dependent_launch.py
    i_s = tl.program_id(0)
    i_layer = tl.program_id(1) // H
    i_h = tl.program_id(1) % H
    i_v = tl.program_id(2)
    i_slot = tl.load(seq_slots + i_s).to(tl.int64)
    i_bos = tl.load(cu_rows + i_s)
    i_rows = rows_to_roll(cu_rows, kept, i_s)
    if i_rows == 0:
        # a padding sequence (graph buckets), or nothing to fold: no state tile is read, nothing is stored
        return
    i_bos = i_bos.to(tl.int64)
    state = _pointer(table, i_layer, STATE, tl.float32)
    key, value, decay, beta, s_key, s_value, s_decay, s_beta = _stash_of_head(table, i_layer, i_h, D_K, D_V, DECAY_K)

    o_k, o_v, m_k, m_v, m_s, o_s = state_tile(i_v, D_K, D_V, BLOCK_K, BLOCK_V)
    p_state = state + (i_slot * H + i_h) * (D_K * D_V) + o_s
    b_s = tl.load(p_state, mask=m_s, other=0.0)  # padded lanes are 0 and stay 0
    b_s = walk_rows(b_s, key + i_bos * s_key, value + i_bos * s_value, decay + i_bos * s_decay, beta + i_bos * s_beta,
                     s_key, s_value, s_decay, s_beta, i_rows, o_k, o_v, m_k, m_v, DECAY_K)
    tl.store(p_state, b_s, mask=m_s)


@triton.jit
def _keep_carry_kernel(table, seq_slots, cu_rows, kept, H: tl.constexpr, D_K: tl.constexpr, D_V: tl.constexpr,
                       DECAY_K: tl.constexpr, CARRY_ROWS: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr,
                       ROW_PROGRAMS: tl.constexpr, PDL: tl.constexpr):
    after_previous(PDL)  # first: kernels/dependent_launch.py
    i_s = tl.program_id(0)
    i_layer = tl.program_id(1) // CHUNKS
    i_chunk = tl.program_id(1) % CHUNKS  # BLOCK values of each of a row's (all heads') key, value, decay, beta
    i_first = tl.program_id(2)  # this program's rows: i_first, i_first + ROW_PROGRAMS, ...
    i_rows = rows_to_roll(cu_rows, kept, i_s)
    if i_rows <= i_first:  # padding, one row (which its verify committed), or no row of this program's
        return
    i_slot = tl.load(seq_slots + i_s).to(tl.int64)
    i_bos = tl.load(cu_rows + i_s).to(tl.int64)
    # a stash row's heads are dense ([H, D] behind the row's first value, the row strided): a row
    # of each tensor is one flat copy, and a program takes one chunk of each
    key, value, decay, beta, s_key, s_value, s_decay, s_beta = _stash_of_head(table, i_layer, 0, D_K, D_V, DECAY_K)
    i_carry = i_slot * CARRY_ROWS  # the slot's carried row 0
    carry_key = _pointer(table, i_layer, CARRY_KEY, tl.float32) + i_carry * (H * D_K)
    carry_value = _pointer(table, i_layer, CARRY_VALUE, tl.float32) + i_carry * (H * D_V)
    carry_decay = _pointer(table, i_layer, CARRY_DECAY, tl.float32) + i_carry * (H * DECAY_K)
    carry_beta = _pointer(table, i_layer, CARRY_BETA, tl.float32) + i_carry * H
    o_x = i_chunk * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] of a row's values
    m_key, m_value, m_decay, m_beta = o_x < H * D_K, o_x < H * D_V, o_x < H * DECAY_K, o_x < H
    for i_t in range(i_first, i_rows, ROW_PROGRAMS):
        i_row = i_bos + i_t
        # the row's four loads issued before any store: the compiler cannot move a load past a store
        # (the pointers may alias), and a copy is four load latencies otherwise
        b_key = tl.load(key + i_row * s_key + o_x, mask=m_key)
        b_value = tl.load(value + i_row * s_value + o_x, mask=m_value)
        b_decay = tl.load(decay + i_row * s_decay + o_x, mask=m_decay)
        b_beta = tl.load(beta + i_row * s_beta + o_x, mask=m_beta)
        tl.store(carry_key + i_t * (H * D_K) + o_x, b_key, mask=m_key)
        tl.store(carry_value + i_t * (H * D_V) + o_x, b_value, mask=m_value)
        tl.store(carry_decay + i_t * (H * DECAY_K) + o_x, b_decay, mask=m_decay)
        tl.store(carry_beta + i_t * H + o_x, b_beta, mask=m_beta)


@triton.jit
def _keep_state_snapshots_kernel(table, seq_slots, cu_rows, kept, H: tl.constexpr, HEAD: tl.constexpr, BLOCK: tl.constexpr,
                                 PDL: tl.constexpr):
    after_previous(PDL)  # first: kernels/dependent_launch.py
    i_s = tl.program_id(0)
    i_layer = tl.program_id(1) // H
    i_h = tl.program_id(1) % H
    i_b = tl.program_id(2)  # a block of the head's HEAD = D_K * D_V values
    i_kept = rows_to_roll(cu_rows, kept, i_s)
    if i_kept == 0:  # padding, or one row, which its verify committed
        return
    i_slot = tl.load(seq_slots + i_s).to(tl.int64)
    i_row = (tl.load(cu_rows + i_s) + i_kept - 1).to(tl.int64)
    state = _pointer(table, i_layer, STATE, tl.float32)
    snapshot = _pointer(table, i_layer, SNAPSHOTS, tl.float32)
    _copy_head_block(snapshot + (i_row * H + i_h) * HEAD, state + (i_slot * H + i_h) * HEAD, i_b, HEAD, BLOCK)


class RecurrentLayers:
    """L alike recurrent layers' committed state and one verify's record of them (shapes in the
    DESIGN.md section 6, "The fused rollback"), checked, with their pointer table (`table`: int64 [L, N_FIELDS] on their
    device; None where no Triton kernel can launch: CPU tensors without the interpreter).

    It holds the tensors (the references read them); what the launchers read is the table alone,
    so whoever keeps a graph that replays them keeps `table` alive, not this object."""

    def __init__(self, windows: list[torch.Tensor], states: list[torch.Tensor], conv_inputs: list[torch.Tensor],
                 keys: list[torch.Tensor], values: list[torch.Tensor], decays: list[torch.Tensor], betas: list[torch.Tensor],
                 snapshots: list[torch.Tensor] | None = None, store: TableStore | None = None,
                 carries: list[tuple[torch.Tensor, ...]] | None = None):
        """store: made inside a CUDA graph capture (the draft chain's, which captures its verifies
        and rollbacks in one graph): the table is rows of the store, allocated before the capture,
        and written by `fill_table()` once the capture has ended; the addresses it will hold are
        read now. carries: per layer the slots' carried rows (keys [n_slots, C, H, D_K], values,
        decays, betas: verifier/model/state.py's CarriedRows), which keep_carry writes."""
        op = "RecurrentLayers"
        per_layer = dict(windows=windows, states=states, conv_inputs=conv_inputs, keys=keys, values=values, decays=decays,
                         betas=betas, **({} if snapshots is None else dict(snapshots=snapshots)))
        n_layers = len(states)
        for name, tensors in per_layer.items():
            if n_layers == 0 or len(tensors) != n_layers:
                raise ValueError(f"{op}: {name} has {len(tensors)} tensors, states {n_layers}: one per layer, at least one")
        first, window = states[0], windows[0]
        if first.dim() != 4 or window.dim() != 3 or window.shape[2] < 1 or keys[0].dim() != 3 or decays[0].dim() != 3:
            raise ValueError(f"{op}: states[0] must be [n_slots, H, D_K, D_V], windows[0] [n_slots, C, W-1 >= 1], keys[0] "
                             f"[R, H, D_K], decays[0] [R, H, DECAY_K]; got {list(first.shape)}, {list(window.shape)}, "
                             f"{list(keys[0].shape)}, {list(decays[0].shape)}")
        if window.dtype not in TL_DTYPES:
            raise ValueError(f"{op}: windows[0] dtype {window.dtype} is not one of {tuple(TL_DTYPES)}")
        n_slots, self.heads, self.d_k, self.d_v = first.shape
        _, self.channels, keep = window.shape
        self.width, self.conv_dtype = keep + 1, window.dtype
        self.rows, self.decay_k = keys[0].shape[0], decays[0].shape[2]
        if self.decay_k not in (1, self.d_k):
            raise ValueError(f"{op}: decays[0] must be [R, H, 1 or D_K={self.d_k}], got {list(decays[0].shape)}")
        if self.d_k > delta_rule.MAX_D_K:
            raise ValueError(f"{op}: D_K {self.d_k} > {delta_rule.MAX_D_K}: the key dim must fit one register tile")
        rows, heads, f32, on_state = self.rows, self.heads, torch.float32, ("states[0]", first)
        for l in range(n_layers):
            check_tensor(op, f"states[{l}]", states[l], first.shape, f32, on_state, contiguous=True)
            check_tensor(op, f"windows[{l}]", windows[l], (n_slots, self.channels, keep), self.conv_dtype, on_state,
                         layout="[n_slots, C, W-1]", contiguous=True)
            _check_rows(op, f"conv_inputs[{l}]", conv_inputs[l], (rows, self.channels), self.conv_dtype, on_state)
            _check_rows(op, f"keys[{l}]", keys[l], (rows, heads, self.d_k), f32, on_state)
            _check_rows(op, f"values[{l}]", values[l], (rows, heads, self.d_v), f32, on_state)
            _check_rows(op, f"decays[{l}]", decays[l], (rows, heads, self.decay_k), f32, on_state)
            _check_rows(op, f"betas[{l}]", betas[l], (rows, heads), f32, on_state)
            if snapshots is not None:
                check_tensor(op, f"snapshots[{l}]", snapshots[l], (rows, *first.shape[1:]), f32, on_state,
                             layout="[R, H, D_K, D_V]", contiguous=True)
            if carries is not None:
                shapes = delta_rule.carry_shapes(n_slots, carries[0][0].shape[1], heads, self.d_k, self.d_v, self.decay_k)
                for name, t, shape in zip(("keys", "values", "decays", "betas"), carries[l], shapes):
                    check_tensor(op, f"carries[{l}] {name}", t, shape, f32, on_state, contiguous=True)
        self.windows, self.states, self.conv_inputs = windows, states, conv_inputs
        self.keys, self.values, self.decays, self.betas, self.snapshots = keys, values, decays, betas, snapshots
        self.carries = carries
        self.carry_rows = 0 if carries is None else carries[0][0].shape[1]
        self.n_layers = n_layers
        self.table = None  # where no Triton kernel can launch
        if first.is_cuda or interpreting():
            self._host_table = self._table_rows()  # [L][N_FIELDS] addresses and strides
            if store is not None:
                self.table = store.take(n_layers, first.device)
            else:
                self.fill_table()

    def fill_table(self) -> None:
        """Write the pointer table: a host to device copy, so never inside a CUDA graph capture
        (DESIGN.md section 6, "The fused rollback")."""
        rows = torch.tensor(self._host_table, dtype=torch.int64)
        if self.table is None:
            self.table = rows.to(self.states[0].device)
        else:
            self.table.copy_(rows)

    def _table_rows(self) -> list[list[int]]:
        rows = []
        for l in range(self.n_layers):
            entries = dict(window=self.windows[l], conv_inputs=self.conv_inputs[l], state=self.states[l], key=self.keys[l],
                           value=self.values[l], decay=self.decays[l], beta=self.betas[l])
            row = []
            for field in FIELDS:
                if field.endswith("_row_stride"):
                    row.append(entries[field.removesuffix("_row_stride")].stride(0))
                elif field == "snapshots":
                    row.append(0 if self.snapshots is None else self.snapshots[l].data_ptr())
                elif field in CARRY_FIELDS:
                    row.append(0 if self.carries is None else self.carries[l][CARRY_FIELDS.index(field)].data_ptr())
                else:
                    row.append(entries[field].data_ptr())
            rows.append(row)
        return rows


class TableStore:
    """Room for pointer tables, allocated before a CUDA graph capture that makes RecurrentLayers:
    memory allocated inside a capture belongs to the graph's pool, where another graph of that pool
    may write its scratch, and a table must hold still from the capture to the last replay.
    `take(L)` hands out the next L rows [L, N_FIELDS], starting 16-byte aligned as a table of its
    own is (Triton specialises a pointer on its alignment: an unaligned table would compile another
    kernel, inside the capture); whoever keeps the graph keeps the store. `rows`: the layers' rows
    all takes will ask for (each take may skip one more row to align)."""

    def __init__(self, rows: int, device: torch.device):
        self.buffer = torch.empty((2 * rows, len(FIELDS)), dtype=torch.int64, device=device)
        self.used = 0

    def take(self, n_layers: int, device: torch.device) -> torch.Tensor:
        start = self.used + self.used % _ALIGNED_ROWS  # an aligned row: a multiple of _ALIGNED_ROWS (2)
        if start + n_layers > self.buffer.shape[0]:
            raise ValueError(f"TableStore: {n_layers} more layers' rows asked with {self.buffer.shape[0] - start} left")
        if torch.device(device) != self.buffer.device:
            raise ValueError(f"TableStore: rows on {self.buffer.device} asked for layers on {device}")
        self.used = start + n_layers
        return self.buffer[start : self.used]


def _check_rows(op: str, name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
                operand: tuple[str, torch.Tensor]) -> None:
    """A record tensor [R, ...]: this shape and dtype, rows at any stride, each row dense."""
    check_tensor(op, name, t, shape, dtype, operand)
    dense = 1
    for dim in range(t.dim() - 1, 0, -1):
        if t.shape[dim] > 1 and t.stride(dim) != dense:
            raise ValueError(f"{op}: {name} must be dense within a row (rows may be strided), got strides {t.stride()}")
        dense *= t.shape[dim]


# what a launcher needs the layers to hold beyond their record, and the error when they do not
_HOLDS = {"snapshots": "the layers hold no snapshots (a write-on-accept record)",
          "carries": "the layers carry no rows (a pool made without carry_rows)"}


def _check_launch(op: str, layers: RecurrentLayers, seq_slots: torch.Tensor, cu_rows: torch.Tensor, kept: torch.Tensor,
                  holding: str | None = None) -> int:
    """-> S, the sequences of the launch (0: nothing to launch). holding: a key of _HOLDS the launch reads."""
    if holding is not None and getattr(layers, holding) is None:
        raise ValueError(f"{op}: {_HOLDS[holding]}")
    if layers.table is None:
        raise ValueError(f"{op}: the layers have no pointer table (CPU tensors without TRITON_INTERPRET=1)")
    check_launchable(op, "table", layers.table)
    on_table = ("table", layers.table)
    check_ragged(op, seq_slots, cu_rows, on_table)
    check_tensor(op, "kept", kept, seq_slots.shape, torch.int32, on_table, layout="[S]")
    return seq_slots.shape[0] if layers.rows else 0


def next_windows(layers: RecurrentLayers, seq_slots: torch.Tensor, cu_rows: torch.Tensor, kept: torch.Tensor) -> None:
    """In place, every layer l: windows[l][slot] = the last W-1 of (windows[l][slot] ++ the first
    kept[s] rows of conv_inputs[l] of s). kept[s] = 0 leaves the slot alone; kept[s] within the
    rows of s is not checked (that would sync)."""
    n_seqs = _check_launch("next_windows", layers, seq_slots, cu_rows, kept)
    if n_seqs == 0:
        return
    block_c = min(WINDOW_BLOCK_C, triton.next_power_of_2(layers.channels))
    c_blocks = triton.cdiv(layers.channels, block_c)
    _next_windows_kernel[(n_seqs, layers.n_layers * c_blocks)](
        layers.table, seq_slots, cu_rows, kept,
        C=layers.channels, W=layers.width, CONV_DTYPE=TL_DTYPES[layers.conv_dtype], BLOCK_C=block_c,
        BLOCK_W=triton.next_power_of_2(layers.width - 1), C_BLOCKS=c_blocks,
        num_warps=short_conv.NUM_WARPS, num_stages=1, **launch_options(kept.device),
    )


def fold_states(layers: RecurrentLayers, seq_slots: torch.Tensor, cu_rows: torch.Tensor, kept: torch.Tensor) -> None:
    """In place, every layer l: states[l][slot] advanced by the first kept[s] stash rows of s, with
    the update verify applies (delta_rule_fold on each layer). kept[s] = 0, or s of one row (its
    verify committed it), leaves the slot alone."""
    n_seqs = _check_launch("fold_states", layers, seq_slots, cu_rows, kept)
    if n_seqs == 0:
        return
    cfg = delta_rule.delta_rule_config(layers.d_k, layers.d_v)
    _fold_states_kernel[(n_seqs, layers.n_layers * layers.heads, triton.cdiv(layers.d_v, cfg.BLOCK_V))](
        layers.table, seq_slots, cu_rows, kept,
        H=layers.heads, D_K=layers.d_k, D_V=layers.d_v, DECAY_K=layers.decay_k, BLOCK_K=cfg.BLOCK_K, BLOCK_V=cfg.BLOCK_V,
        num_warps=cfg.num_warps, num_stages=1, enable_fp_fusion=False, **launch_options(kept.device),
    )


def keep_state_snapshots(layers: RecurrentLayers, seq_slots: torch.Tensor, cu_rows: torch.Tensor, kept: torch.Tensor) -> None:
    """In place, every layer l: states[l][slot] = snapshots[l][cu_rows[s] + kept[s] - 1] where kept[s] > 0
    and s has more than one row (a one-row verify committed its row, which is that snapshot)."""
    n_seqs = _check_launch("keep_state_snapshots", layers, seq_slots, cu_rows, kept, holding="snapshots")
    if n_seqs == 0:
        return
    head = layers.d_k * layers.d_v
    _keep_state_snapshots_kernel[(n_seqs, layers.n_layers * layers.heads, triton.cdiv(head, SNAPSHOT_BLOCK))](
        layers.table, seq_slots, cu_rows, kept, H=layers.heads, HEAD=head, BLOCK=SNAPSHOT_BLOCK,
        num_warps=SNAPSHOT_NUM_WARPS, **launch_options(kept.device),
    )


def keep_carry(layers: RecurrentLayers, seq_slots: torch.Tensor, cu_rows: torch.Tensor, kept: torch.Tensor) -> None:
    """Every layer l: rows 0 .. kept[s]-1 of sequence s's stash (keys, values, decays, betas) copied
    to its slot's carried rows, for s of more than one row (a one-row verify committed its row):
    write-on-accept rollback where the next verify applies them (verifier/model/rollback.py). A copy:
    the bits are the stash's."""
    n_seqs = _check_launch("keep_carry", layers, seq_slots, cu_rows, kept, holding="carries")
    if n_seqs == 0:
        return
    longest = layers.heads * max(layers.d_k, layers.d_v)  # a row's values in its longest tensor
    chunks = triton.cdiv(longest, CARRY_BLOCK)
    row_programs = carry_row_programs(n_seqs, layers.carry_rows)
    _keep_carry_kernel[(n_seqs, layers.n_layers * chunks, row_programs)](
        layers.table, seq_slots, cu_rows, kept, H=layers.heads, D_K=layers.d_k, D_V=layers.d_v, DECAY_K=layers.decay_k,
        CARRY_ROWS=layers.carry_rows, BLOCK=min(CARRY_BLOCK, triton.next_power_of_2(longest)), CHUNKS=chunks,
        ROW_PROGRAMS=row_programs, num_warps=CARRY_NUM_WARPS, **launch_options(kept.device),
    )


def carry_row_programs(n_seqs: int, carry_rows: int) -> int:
    """Programs a sequence's kept rows are dealt among, per layer and chunk: a few sequences' rows
    copied one program each (a batch-1 rollback walked a sequence's rows in one program, one
    row's load latency after another, most of the rollback graph's GPU time under the profiler),
    many sequences' in one (programs are what the copies cost there). A copy: the bits do not
    depend on it. bench.gpu's `rollback` section times the WOA rollback a K = 8 verify pays."""
    return max(1, min(carry_rows, CARRY_SEQUENCE_PROGRAMS // max(n_seqs, 1)))


def keep_carry_ref(layers: RecurrentLayers, seq_slots: torch.Tensor, cu_rows: torch.Tensor, kept: torch.Tensor) -> None:
    """keep_carry in torch."""
    if layers.carries is None:
        raise ValueError(f"keep_carry_ref: {_HOLDS['carries']}")
    bounds = cu_rows.tolist()
    for s, (slot, n) in enumerate(zip(seq_slots.tolist(), kept.tolist())):
        if n == 0 or bounds[s + 1] - bounds[s] == 1:
            continue
        for carry, stash in zip(layers.carries, zip(layers.keys, layers.values, layers.decays, layers.betas)):
            for kept_rows, rows in zip(carry, stash):
                kept_rows[slot, :n] = rows[bounds[s] : bounds[s] + n]


def next_windows_ref(layers: RecurrentLayers, seq_slots: torch.Tensor, cu_rows: torch.Tensor, kept: torch.Tensor) -> None:
    """next_windows in torch: short_conv.next_window_ref on each layer."""
    for window, inputs in zip(layers.windows, layers.conv_inputs):
        short_conv.next_window_ref(window, inputs, seq_slots, cu_rows, kept)


def fold_states_ref(layers: RecurrentLayers, seq_slots: torch.Tensor, cu_rows: torch.Tensor, kept: torch.Tensor) -> None:
    """fold_states in torch: delta_rule.delta_rule_fold_ref on each layer."""
    for state, key, value, decay, beta in zip(layers.states, layers.keys, layers.values, layers.decays, layers.betas):
        delta_rule.delta_rule_fold_ref(state, key, value, decay, beta, seq_slots, cu_rows, kept)


def keep_state_snapshots_ref(layers: RecurrentLayers, seq_slots: torch.Tensor, cu_rows: torch.Tensor, kept: torch.Tensor) -> None:
    """keep_state_snapshots in torch: keep_snapshots_ref on each layer."""
    if layers.snapshots is None:
        raise ValueError("keep_state_snapshots_ref: the layers hold no snapshots (a write-on-accept record)")
    for state, snapshot in zip(layers.states, layers.snapshots):
        keep_snapshots_ref(state, snapshot, seq_slots, cu_rows, kept)
