"""The MTP head's draft cost at real size (bench/fp8_real_size.py's last phase): at batch 1 on the
real-size block-FP8 MoE, the time to draft K = 1..4 tokens after a verify that accepted one draft, as
verifier/proposers/mtp.py drafts: a catch-up forward over the accepted rows (the accepted draft's and
the bonus's), then K - 1 one-row forwards, each with the full LM head. Each K against its own floor
(bench/step_floor.py's draft_bytes: the head's layer, fc and norms, the LM head once per drafted
token, embedding rows, the experts its rows route to, KV; the same steps replayed with the routers
hooked) and against a batch-1 decode step. Timed two ways in one run: `ms`, the product's in-process
path on CUDA (verifier/proposers/mtp_chain.py: the proposal as one CUDA graph replay), and
`ms_eager`, the same forwards launched one by one with a host read of each draft (what the server's
batched proposals run). Random weights: acceptance means nothing here, only the cost.

fp8_real_size.py loads the model and calls mtp_draft; it passes its warm-up count and its log, so
that the MTP figure warms up as its other figures do and logs beside them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch

from bench.gpu import PROMPT_LEN, kernel_table, median_ms
from bench.step_floor import DraftForward, distinct_experts, draft_sizes, mean_draft_floor, recorded_routing
from hybrid_kernels.runtime import pick
from hybrid_kernels.sampling import argmax_rows, argmax_rows_ref
from verifier.model import RowBatch, load_mtp_head
from verifier.model.device_scope import device_scope
from verifier.params import SamplingParams
from verifier.proposers.mtp_chain import MTPChain

MTP_KS = (1, 2, 3, 4)  # tokens an MTP draft proposes, one figure each
# The timed MTP drafts follow a verify that accepted one draft: the head first catches up over two
# rows, the accepted draft's and the bonus's (verifier/proposers/mtp.py's catch-up).
MTP_CATCH_UP = 2


def prompt_hidden(model) -> torch.Tensor:
    """[PROMPT_LEN, H] in the model's dtype: a prompt's final-normed hidden rows (the LM head's
    input, the MTP head's), from a prefill of a one-slot pool."""
    prompt = torch.randint(3, 1000, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    hidden = torch.empty(PROMPT_LEN, model.config.hidden_size, dtype=model.dtype, device=model.device)
    model.prefill(model.new_pool(1, PROMPT_LEN), 0, prompt, hidden_out=hidden)
    return hidden


class MTPDrafts:
    """One sequence drafting greedily with the MTP head at batch 1 as verifier/proposers/mtp.py
    drafts (its documented steps, run here through MTPHead.forward so that each forward's rows and
    routing are seen): a catch-up forward over the rows the last verify consumed, then K - 1 one-row
    forwards, each fed the last one's output row and its argmax (argmax_rows, read on the host: one
    sync a forward, as the proposer's). The hidden row of position q is the prompt's row
    q % PROMPT_LEN (its values only steer the routing); the tokens are drawn. `routed`, when a
    list, collects (start, rows, routing) of each forward."""

    def __init__(self, head, hidden: torch.Tensor, max_seq_len: int):
        self.head = head
        self.pool = head.new_pool(1, max_seq_len)
        self.slot = self.pool.admit()
        n = hidden.shape[0]
        self.hidden = hidden[torch.arange(max_seq_len, device=hidden.device) % n]  # [max_seq_len, H]
        self.tokens = torch.randint(3, 1000, (max_seq_len + 1,), generator=torch.Generator().manual_seed(3)).tolist()
        self.routed: list | None = None
        with device_scope(head.device):
            self._forward(0, self.tokens[1 : n + 1], self.hidden[:n], 0)  # the proposer's first catch-up: the prompt's rows
        self.p = n  # the pending token's position

    def _forward(self, start: int, tokens: list[int], hidden: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """MTPHead.forward over rows start .. start + len(tokens) - 1 -> (out [rows, H], logits [rows, vocab])."""
        batch = RowBatch(slots=(self.slot,), starts=(start,), counts=(len(tokens),))
        ids = torch.tensor(tokens, dtype=torch.int64)
        # row_invariant=False as the proposer runs it (on CUDA the kernels are row-invariant either way)
        if self.routed is None:
            return self.head.forward(ids, hidden, batch, self.pool, row_invariant=False, step=step)
        with recorded_routing(SimpleNamespace(blocks=self.head.layers)) as routed:
            result = self.head.forward(ids, hidden, batch, self.pool, row_invariant=False, step=step)
        self.routed.append((start, len(tokens), routed))
        return result

    def step(self, k: int) -> list[int]:
        """A steady step: the pending token MTP_CATCH_UP positions on, the catch-up over those rows
        (its last row's logits give draft 1), then drafts 2 .. k one row each -> the k drafts."""
        self.p += MTP_CATCH_UP
        p, c = self.p, MTP_CATCH_UP
        with device_scope(self.head.device):
            out, logits = self._forward(p - c, self.tokens[p - c + 1 : p + 1], self.hidden[p - c : p], 0)
            drafts = self._argmax(logits[-1:])
            for i in range(1, k):  # draft i + 1 at position p - 1 + i, as the proposer places it
                out, logits = self._forward(p - 1 + i, drafts[-1:], out[-1:], i)
                drafts += self._argmax(logits)
        return drafts

    @staticmethod
    def _argmax(logits: torch.Tensor) -> list[int]:
        """[1, vocab] fp32 -> [its argmax], as the proposer chooses a greedy draft."""
        return pick(argmax_rows, argmax_rows_ref, logits)(logits).tolist()


class ChainDrafts(MTPDrafts):
    """MTPDrafts' steps through an MTPChain (greedy): the same catch-up and one-row forwards, captured
    once per K and replayed (on the CPU its body runs eagerly: the tests)."""

    def __init__(self, head, hidden: torch.Tensor, max_seq_len: int):
        super().__init__(head, hidden, max_seq_len)
        graphed = torch.device(head.device).type == "cuda"
        self.chain = MTPChain(head, self.pool, self.slot, max(MTP_KS), SamplingParams(), graphed=graphed)

    def step(self, k: int) -> list[int]:
        self.p += MTP_CATCH_UP
        p, c = self.p, MTP_CATCH_UP
        return self.chain.propose(p - c, self.tokens[p - c + 1 : p + 1], self.hidden[p - c : p], k)


def mtp_draft(path: Path, model, steps: int, bandwidth: float | None, decode_ms: float | None, *, warmup: int,
              log: Callable[[str], None]) -> dict:
    """The MTP head loaded from path, and per K in MTP_KS the cost of a draft (MTPDrafts.step):
    median ms over `steps` (CUDA: with a bandwidth), its own floor (bench/step_floor.py: draft_bytes,
    the mean over the same steps replayed with the routers hooked), ratio (ms over floor_ms),
    ratio_to_decode (ms over a batch-1 decode step's) and on CUDA the kernel table of the last step.
    warmup: untimed steps before the timed ones; log: where each K's line goes."""
    start = time.perf_counter()
    head = load_mtp_head(path, model)
    if head is None:
        raise ValueError(f"{path}: no mtp.* tensors (written without the MTP head)")
    out = {"load_s": time.perf_counter() - start, "layers": head.n_layers, "mlp": head.config.mlps[0], "catch_up_rows": MTP_CATCH_UP}
    hidden = prompt_hidden(model)
    length = PROMPT_LEN + MTP_CATCH_UP * (warmup + steps) + max(MTP_KS)
    sizes = draft_sizes(head, head.new_pool(1, 1))
    # the head's own weights (its LM head and embedding are the model's)
    out["weight_bytes"] = sizes.mtp_layer + sizes.fc_and_norms + sizes.n_experts * sizes.expert
    out["drafts"] = {}
    for k in MTP_KS:
        ms = ms_eager = None
        if bandwidth is not None:
            eager, chained = MTPDrafts(head, hidden, length), ChainDrafts(head, hidden, length)
            ms_eager = median_ms(lambda: eager.step(k), steps, warmup)
            ms = median_ms(lambda: chained.step(k), steps, warmup)
        figure = draft_floor(head, hidden, length, sizes, k, steps, warmup, bandwidth)
        figure["ms"], figure["ms_eager"] = ms, ms_eager
        figure["ratio"] = None if ms is None else ms / figure["floor_ms"]
        figure["ratio_to_decode"] = None if ms is None or decode_ms is None else ms / decode_ms
        out["drafts"][str(k)] = figure
        experts = " / ".join(f"{n:.1f}" for n in figure["distinct_experts"]["per_forward"])
        log(f"MTP draft K={k}: {figure['total_bytes'] / 1e9:.3f} GB, experts per forward {experts}"
            + (f"; {ms:.2f} ms graphed ({ms_eager:.2f} eager), {figure['ratio']:.1f}x its floor {figure['floor_ms']:.2f} ms, "
               f"{figure['ratio_to_decode']:.2f}x a decode step" if ms is not None else ""))
    return out


def draft_floor(head, hidden: torch.Tensor, length: int, sizes, k: int, steps: int, warmup: int, bandwidth: float | None) -> dict:
    """The steps mtp_draft times, replayed with the routers hooked: mean_draft_floor over the timed
    ones, and (with a bandwidth) `kernel_breakdown`, the kernel table of the last step."""
    run = MTPDrafts(head, hidden, length)
    run.routed = []
    drafts, kernels = [], None
    for i in range(warmup + steps):
        if bandwidth is not None and i == warmup + steps - 1:
            kernels = kernel_table(lambda: run.step(k))
        else:
            run.step(k)
        forwards = [DraftForward(start, rows, sum(distinct_experts(routed).values())) for start, rows, routed in run.routed]
        run.routed.clear()
        if i >= warmup:
            drafts.append(forwards)
    return {**mean_draft_floor(drafts, sizes, bandwidth), "kernel_breakdown": kernels}
