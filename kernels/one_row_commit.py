"""The one rule every rollback of a slot's conv window and recurrent state follows.

A step always consumes a sequence's first row (the pending token), so the row of a one-row
sequence (a decode) is accepted before it is verified: its verify commits it at once (conv_rows
writes the slot's conv window, the delta rule its recurrent state), and rollback leaves that slot
alone. A sequence of more rows is verified read-only (write-on-accept) and rolled back to its kept
rows. The scratch slot (the pool's last, where graph buckets put their padding rows) is never
committed: padding sequences may share it, and it stays zero.

Why: a decode then reads and writes its state once. At 64 decoding sequences of the 2B model the
GDN states are 2.4 GB; a read-only verify and a fold moved them three times. And a step of
one-row sequences only needs no rollback at all (verifier/model/step.py skips it).
"""

import triton
import triton.language as tl


@triton.jit
def rows_to_roll(cu_rows, kept, i_s):
    """How many of sequence i_s's rows a rollback still applies to its slot: kept[i_s], or 0 for a
    sequence of one row, whose verify committed it."""
    return tl.where(tl.load(cu_rows + i_s + 1) - tl.load(cu_rows + i_s) == 1, 0, tl.load(kept + i_s))


@triton.jit
def commits(i_rows, i_slot, scratch_slot):
    """Whether a verify of i_rows rows in slot i_slot commits what it computed (scratch_slot: the
    pool's scratch slot, or -1 where none is exempt)."""
    return (i_rows == 1) & (i_slot != scratch_slot)
