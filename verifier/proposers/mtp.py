"""The MTP drafter: the checkpoint's own multi-token-prediction head (verifier/model/mtp.py) drafting
greedily from the target's hidden rows, in process.

Inputs. The head reads the target's final-normed hidden row at position q (the LM head's input)
with the token at q + 1, and its logits predict the token at q + 2. The engine hands those rows
over: the prompt's from the prefill (`Engine.open(want_hidden=True)`, `begin`) and each step's
consumed rows (`StepRequest.want_hidden`, `observe`), so the proposer holds the hidden rows of
positions 0 .. p - 1 when the context is p + 1 tokens long (the last one, the pending token at p,
not yet consumed by the target). generate() does this for any `HiddenStateProposer`.

`propose(context, k)`:
  1. catch up: one forward of MTP layer 0 over the rows q = fed .. p - 1 not yet fed, row q being
     (hidden q, token context[q + 1]); the last one's token is the pending token (the bonus the
     last verify emitted), and its logits give draft 1. These rows are the accepted stream's, so
     their KV rows are final: `fed` becomes p.
  2. recurrent drafts: draft i + 1 from a one-row forward of (the previous forward's output row,
     draft i), MTP layer i % n (vLLM's order), each one position on.
Positions (vLLM's eagle.py proposer, which runs qwen3_next_mtp and qwen3_5_mtp: its input ids are
the target's shifted by one, its positions the target's unshifted): row (hidden q, token q + 1)
has attention position q, the position of the hidden row it reads, one before the token it embeds;
its K/V go to row q of the head's own pool, and a recurrent draft row takes the next position.
Rollback: the head's layers are plain attention, whose cursor is the position: the draft rows of
the last proposal lie at positions >= fed, and the next catch-up overwrites them from `fed` on
before any row reads them (a row attends to positions <= its own), so nothing is copied.

Bits. Drafts only decide what the target verifies; the target's acceptance picks every emitted
token (greedy: its argmax; seeded sampling: its coupled sample), so the stream equals plain
decoding whatever the head drafts. A step that asks for hidden rows verifies eagerly
(Step.verify), so with CUDA graphs on, an MTP session's steps run without them (same bits).
Greedy drafts only: a sampled session still gets the head's argmax (no q is sent), which verify
treats as a deterministic draft; drafting with the session's coupled noise or sending q for
rejection sampling is not done here.

One MTPProposer follows one sequence at a time: `begin` starts a new one.
"""

from __future__ import annotations

import torch

from ..model.device_scope import device_scope
from ..model.mtp import MTPHead
from ..model.rows import RowBatch


class MTPProposer:
    def __init__(self, head: MTPHead, max_seq_len: int):
        """max_seq_len: the engine's (its pool's): the most positions a sequence reaches."""
        self.head = head
        self.max_seq_len = max_seq_len
        self.pool = head.new_pool(1, max_seq_len)
        self.slot = self.pool.admit()
        self.hidden = torch.empty(max_seq_len, head.config.hidden_size, dtype=head.dtype, device=head.device)
        self.known = 0  # hidden rows held: positions 0 .. known - 1
        self.fed = 0  # head KV rows final: positions 0 .. fed - 1 hold (hidden q, token q + 1) of the accepted stream

    def begin(self, prompt_hidden: torch.Tensor) -> None:
        """A new sequence, whose prompt rows' hidden rows are prompt_hidden [len(prompt), H]."""
        self.known = self.fed = 0
        self.observe(prompt_hidden)

    def observe(self, hidden: torch.Tensor) -> None:
        """The hidden rows [n, H] of the next n positions the target consumed (a step's StepResult.hidden)."""
        n = hidden.shape[0]
        if self.known + n > self.max_seq_len:
            raise ValueError(f"MTPProposer: {self.known} + {n} hidden rows pass max_seq_len {self.max_seq_len}")
        self.hidden[self.known : self.known + n].copy_(hidden)
        self.known += n

    def propose(self, context: list[int], k: int) -> list[int]:
        """Up to k greedy drafts for the positions after context (module docstring)."""
        p = len(context) - 1  # the pending token's position
        if self.known != p:
            raise ValueError(f"MTPProposer: hidden rows of {self.known} positions held, but a context of {len(context)} "
                             f"tokens needs {p} (begin with the prompt's, then observe every step's)")
        if k <= 0 or p < 1:
            return []
        head, slot = self.head, self.slot
        # rows from `fed` on (at least the last one: a repeated call re-feeds it, the same KV row)
        start = min(self.fed, p - 1)
        with device_scope(head.device):
            batch = RowBatch(slots=(slot,), starts=(start,), counts=(p - start,))
            out, logits = head.forward(torch.tensor(context[start + 1 : p + 1], dtype=torch.int64), self.hidden[start:p], batch,
                                       self.pool, row_invariant=True, step=0)
            self.fed = p
            drafts = [int(torch.argmax(logits[-1]))]
            row = out[-1:]
            for i in range(1, k):
                position = p - 1 + i
                if position >= self.max_seq_len:
                    break
                batch = RowBatch(slots=(slot,), starts=(position,), counts=(1,))
                row, logits = head.forward(torch.tensor(drafts[-1:], dtype=torch.int64), row, batch, self.pool,
                                           row_invariant=True, step=i)
                drafts.append(int(torch.argmax(logits[0])))
        return drafts
