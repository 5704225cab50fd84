"""Padding a step to a graph bucket's fixed shape.
The design in full: DESIGN.md section 6, "Padding to a bucket".
"""

from __future__ import annotations

from dataclasses import dataclass

from .rows import RowBatch
from .sizes import DEFAULT_MAX_K

# Most rows per padding sequence: a verify at K = DEFAULT_MAX_K - 1 walks DEFAULT_MAX_K rows (at
# DEFAULT_MAX_K, the largest K the default buckets are sized for, one more), so padding never walks
# longer than a real verify of a full-K batch. Smaller chunks would cost more padding sequences, each
# reading the scratch slot's recurrent state once (a whole state per sequence and layer), for walks
# shorter than the real ones already are.
PAD_CHUNK = DEFAULT_MAX_K

# Rows a sequence of a padded step is taken to have where a bucket sizes the split of its walks
# (`walk_sequences`): a verify's at DEFAULT_MAX_K.
WALK_ROWS = PAD_CHUNK + 1


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
    """One shape per bucket: S_b = min(R_b, n_slots + ceil(R_b / PAD_CHUNK)) (DESIGN.md section 6, "Padding to a bucket")."""
    return [BucketShape(rows, min(rows, n_slots - (-rows // PAD_CHUNK))) for rows in graph_rows]


def buckets(graph_rows: tuple[int, ...], n_slots: int, one_sequence_rows: int) -> list[BucketShape]:
    """Every bucket a step may replay, in one list sorted by (rows, sequences): the shared buckets
    (`bucket_shapes`) and one sequence's, (R, 1) for R in 1 .. one_sequence_rows capped at the largest
    shared bucket's rows (so that which steps run eagerly is graph_rows' choice alone), each once
    ((1, 1) is both)."""
    shared = bucket_shapes(graph_rows, n_slots)
    largest = shared[-1].rows if shared else 0
    one_sequence = [BucketShape(rows, 1) for rows in range(1, min(one_sequence_rows, largest) + 1)]
    return sorted(set(shared + one_sequence), key=lambda s: (s.rows, s.sequences))


def fits(shape: BucketShape, batch: RowBatch) -> bool:
    """Whether `batch` pads to `shape`: its rows fit, and its sequences with the padding sequences
    its missing rows need (PAD_CHUNK rows each)."""
    n_rows = batch.n_rows
    return n_rows <= shape.rows and len(batch.slots) - (-(shape.rows - n_rows) // PAD_CHUNK) <= shape.sequences


def bucket_for(shapes: list[BucketShape], batch: RowBatch) -> BucketShape | None:
    """The bucket a step replays: the first of `shapes` (sorted by rows, then sequences) that it
    fits; None past the largest. One rule for every step: a step of one sequence of R rows fits its
    exact one-sequence bucket (R, 1) first, where there is one (nothing to pad), and any other step
    the smallest shared bucket of at least its rows (a shared bucket always holds a step of its rows
    or fewer: DESIGN.md section 6, "Padding to a bucket": S_b; a one-sequence bucket never holds two sequences, nor one
    with padding)."""
    n_rows, n_seqs = batch.n_rows, len(batch.slots)
    for shape in shapes:  # fits(shape, batch), its counts summed once (a step's critical path)
        if n_rows <= shape.rows and n_seqs - (-(shape.rows - n_rows) // PAD_CHUNK) <= shape.sequences:
            return shape
    return None


def capture_batch(shape: BucketShape, scratch_slot: int) -> RowBatch:
    """The padding-only batch a bucket's graphs are captured on, of the bucket's shape: a shared
    bucket's padding (`pad_batch` of no rows); a one-sequence bucket's one sequence of all its rows in
    the scratch slot, since its steps have no padding sequence to hold its rows in PAD_CHUNK's."""
    if shape.sequences == 1:
        return RowBatch((scratch_slot,), (0,), (shape.rows,), scratch_slot=scratch_slot)
    return pad_batch(RowBatch((), (), ()), shape, scratch_slot)


def pad_batch(batch: RowBatch, shape: BucketShape, scratch_slot: int) -> RowBatch:
    """`batch` followed by its padding sequences (DESIGN.md section 6, "Padding to a bucket"), a RowBatch of exactly
    shape.rows rows in shape.sequences sequences: `batch` itself when it fits the shape already
    (no batch to build on a step's critical path; a batch's scratch_slot only exempts its padding
    sequences from RowBatch's checks, and it has none)."""
    n_rows, n_seqs = batch.n_rows, len(batch.slots)
    if n_rows == shape.rows and n_seqs == shape.sequences:
        return batch
    padding = shape.sequences - n_seqs
    assert n_rows <= shape.rows and n_seqs <= shape.sequences, \
        f"a step of {n_rows} rows in {n_seqs} sequences does not fit bucket {shape}"
    chunks = _chunks(shape.rows - n_rows)
    assert len(chunks) <= padding, f"{len(chunks)} padding sequences needed, {padding} left in bucket {shape}"
    empty = padding - len(chunks)
    return RowBatch(
        slots=batch.slots + (scratch_slot,) * padding,
        starts=batch.starts + tuple(PAD_CHUNK * j for j in range(len(chunks))) + (0,) * empty,
        counts=batch.counts + chunks + (0,) * empty,
        scratch_slot=scratch_slot,
        carried=batch.carried + (0,) * padding if batch.carried else (),
    )


def walk_sequences(batch: RowBatch) -> int:
    """How many sequences a batch's sequence walks are split for (kernels/short_conv.py conv_runs): a
    batch as it is, its own. A batch padded to a graph bucket is captured on padding alone and replayed
    with every step that fits the bucket, and its S_b sequences are mostly padding: split for them, one
    sequence of 9 rows in the 10-row bucket (S_b = 10) would walk its rows in one run where the same
    step unpadded takes 4. So a padded batch is split for the fewest sequences of WALK_ROWS rows that
    hold its rows: steps of one or two long verifies get the split, and a split that finds a sequence of
    fewer rows than runs leaves the rest of its programs with nothing to do (they return at once). A
    batch of one sequence (a one-sequence bucket's, captured on one sequence: capture_batch) is split
    for that sequence, as its steps are."""
    if batch.scratch_slot is None or len(batch.slots) == 1:
        return len(batch.slots)
    return max(1, -(-batch.n_rows // WALK_ROWS))


def _chunks(padding_rows: int) -> tuple[int, ...]:
    """Rows of each padding sequence with rows: PAD_CHUNK each, the last one the remainder."""
    full, rest = divmod(padding_rows, PAD_CHUNK)
    return (PAD_CHUNK,) * full + ((rest,) if rest else ())


def padded_kept(consumed: list[int], shape: BucketShape) -> list[int]:
    """Rows each sequence of the padded batch keeps: the real sequences' counts, then 0 per padding sequence."""
    return consumed + [0] * (shape.sequences - len(consumed))
