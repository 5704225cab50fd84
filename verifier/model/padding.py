"""Padding a step to a graph bucket's fixed shape (DESIGN.md section 6, rule 9).

A bucket is a fixed (rows R_b, sequences S_b). A step of R <= R_b verify rows in S sequences is
padded to it: its S sequences first, as they are; then one padding sequence holding the R_b - R
padding rows (token 0 at positions 0 .. R_b - R - 1 of the pool's scratch slot); then padding
sequences with no rows, also in the scratch slot, up to S_b. Rollback keeps 0 rows of every
padding sequence. So padding:
  - changes no real row's bits: every per-row op is row-invariant, and the sequence-walking kernels
    (conv, delta rule, attention) read only their own sequence's slot;
  - writes no real slot's state: padding rows write KV only in the scratch slot, verify never
    writes a committed conv window or recurrent state, and the rollback kernels return at once for
    a sequence that keeps nothing (so the scratch slot's window and state stay zero, and hundreds
    of zero-row sequences cost a program each that loads two ints).

S_b = min(R_b, n_slots + 1) always fits: a full bucket (R = R_b) has at most min(R_b, n_slots)
sequences and needs no padding sequence; a step with R < R_b has S <= min(R, n_slots) <= S_b - 1,
room for the padding sequence.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from .rows import RowBatch


@dataclass(frozen=True)
class BucketShape:
    rows: int  # R_b verify rows
    sequences: int  # S_b sequences, padding ones included


def check_graph_rows(graph_rows: tuple[int, ...], max_seq_len: int) -> tuple[int, ...]:
    """Bucket row counts, validated: positive, increasing, each fitting max_seq_len (the scratch
    slot holds a bucket's padding rows at positions 0 .. R_b - 1)."""
    rows = tuple(int(r) for r in graph_rows)
    if any(r < 1 for r in rows) or list(rows) != sorted(set(rows)):
        raise ValueError(f"graph_rows must be positive and strictly increasing, got {list(graph_rows)}")
    if rows and rows[-1] > max_seq_len:
        raise ValueError(f"graph_rows {rows[-1]} passes max_seq_len {max_seq_len}: "
                         "a bucket's padding rows must fit the scratch slot")
    return rows


def bucket_shapes(graph_rows: tuple[int, ...], n_slots: int) -> list[BucketShape]:
    return [BucketShape(rows, min(rows, n_slots + 1)) for rows in graph_rows]


def smallest_bucket(shapes: list[BucketShape], n_rows: int) -> BucketShape | None:
    """The smallest bucket of at least n_rows rows (shapes sorted by rows); None past the largest."""
    i = bisect.bisect_left([s.rows for s in shapes], n_rows)
    return shapes[i] if i < len(shapes) else None


def pad_batch(batch: RowBatch, shape: BucketShape, scratch_slot: int) -> RowBatch:
    """`batch` followed by its padding sequences (module docstring), a RowBatch of exactly
    shape.rows rows in shape.sequences sequences."""
    n_rows, n_seqs = batch.n_rows, len(batch.slots)
    padding = shape.sequences - n_seqs
    assert n_rows <= shape.rows and n_seqs <= shape.sequences, \
        f"a step of {n_rows} rows in {n_seqs} sequences does not fit bucket {shape}"
    assert padding >= 1 or n_rows == shape.rows, f"no sequence left in bucket {shape} for {shape.rows - n_rows} padding rows"
    if padding == 0:
        return RowBatch(batch.slots, batch.starts, batch.counts, scratch_slot)
    return RowBatch(
        slots=batch.slots + (scratch_slot,) * padding,
        starts=batch.starts + (0,) * padding,
        counts=batch.counts + (shape.rows - n_rows,) + (0,) * (padding - 1),
        scratch_slot=scratch_slot,
    )


def padded_kept(consumed: list[int], shape: BucketShape) -> list[int]:
    """Rows each sequence of the padded batch keeps: the real sequences' counts, then 0 per padding sequence."""
    return consumed + [0] * (shape.sequences - len(consumed))
