"""The hybrid decoder: embedding, pre-norm blocks (token mixer, then MLP/MoE), final norm, LM head.

`forward` computes logits for a ragged RowBatch and writes every row into its slot's state
(prefill). `compute` is the forward itself, which a step (verifier/model/step.py: verify, then
rollback) runs row-invariantly (see ops.py) on inputs it has checked and moved to the device.

Tensor parallelism (verifier/model/parallel/): a model loaded with a TensorParallel holds its
rank's part of every split weight and a config of its rank's heads; the embedding and the LM head
hold its rank's vocabulary rows. Three collectives join the ranks: the embedding's look-up and each
block's two output projections are summed across ranks, and the logits are gathered, so every rank
returns the same whole-vocabulary logits. Without one (parallel None) no line of the forward changes.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import torch

from hybrid_kernels.linear import SplitSums
from hybrid_kernels.runtime import use_triton

from .checkpoint import CheckpointError, TensorSource
from .config import ATTENTION, GDN, KDA, MLA, MOE, ModelConfig
from .fp8 import BlockFP8Weight, OutFeatureGroups, kept_real
from .hf_config import load_config
from .layers.attention import GatedAttention
from .layers.gdn import GatedDeltaNet
from .layers.kda import KimiDeltaAttention
from .layers.mla import LatentAttention
from .layers.mlp import DenseMLP, MoE, prefill_kernels_differ
from .ops import MixedRows, add_rms_norm, each_row, head_logits, rms_norm
from .parallel.group import TensorParallel
from .parallel.sharding import ShardedSource, local_config
from .rollback import VerifyRecord
from .rows import RowBatch, check_rows, to_device
from .state import RecurrentState, SlotPool

log = logging.getLogger(__name__)

# Prompt tokens per prefill forward; chunks start at its multiples from position 0 (a prefix cache's
# boundaries: verifier/model/prefix_cache.py)
PREFILL_CHUNK = 512

_MIXERS = {ATTENTION: GatedAttention, MLA: LatentAttention, GDN: GatedDeltaNet, KDA: KimiDeltaAttention}


class Block:
    def __init__(self, config: ModelConfig, src: TensorSource, index: int, prefix: str | None = None):
        """prefix: where the block's tensors live (default `model.layers.{index}`; an MTP layer's
        are under `mtp.layers.{j}`, verifier/model/mtp.py)."""
        prefix = prefix or f"model.layers.{index}"
        self.mixer = _MIXERS[config.mixers[index]](config, src, prefix)
        if config.mlps[index] == MOE:
            self.mlp = MoE(config, src, prefix)
        else:
            self.mlp = DenseMLP(src, prefix + ".mlp.", config.hidden_size, config.intermediate_size)
        self.input_norm = src.take(prefix + ".input_layernorm.weight", (config.hidden_size,))
        self.post_norm = src.take(prefix + ".post_attention_layernorm.weight", (config.hidden_size,))


class HybridModel:
    def __init__(self, config: ModelConfig, src: TensorSource, parallel: TensorParallel | None = None):
        """parallel: this rank's place in a tensor-parallel group; then `config` is the rank's
        (parallel.sharding.local_config: its heads, the whole vocabulary) and `src` hands out the
        rank's parts (parallel.sharding.ShardedSource)."""
        self.config = config
        self.parallel = parallel
        self.device = src.device
        self.dtype = src.dtype
        V, H = config.vocab_size, config.hidden_size
        if parallel is not None:  # the rank's rows of the embedding and the LM head (padded past the last id)
            V = len(parallel.vocab_rows(V))
        self.embed = src.take("model.embed_tokens.weight", (V, H))
        self.blocks = [Block(config, src, i) for i in range(config.n_layers)]
        self.final_norm = src.take("model.norm.weight", (H,))
        # A stored head wins even when the config says tied: transformers' Kimi port never ties and
        # saves its head, and a Qwen file that stores the tied copy holds the embedding anyway.
        if src.has("lm_head.weight") or not config.tie_word_embeddings:
            self.lm_head = src.take("lm_head.weight", (V, H))
        else:
            self.lm_head = self.embed
        leftovers = src.leftovers()
        if leftovers:
            shown = ", ".join(repr(n) for n in leftovers[:8])
            more = f" and {len(leftovers) - 8} more" if len(leftovers) > 8 else ""
            raise CheckpointError(f"unexpected tensor(s) for a {config.model_type} model of this config: {shown}{more}")

    def keep_fp8_reals(self) -> int:
        """Keep every dense block-FP8 weight's real values beside it (fp8.kept_real), for the GEMMs
        of DEQUANTIZED_ROWS rows or more (a step of many sequences), which then read them instead of
        dequantizing the weight each call: the same bits, 2 bytes a weight element more memory
        (2.6 GB at Qwen3.6-35B-A3B), a launch fewer per weight. -> bytes added."""
        added = 0
        for block in self.blocks:
            for part in (block.mixer, block.mlp):
                for name, weight in list(vars(part).items()):
                    kept = kept_real(weight)
                    if kept is not weight:
                        setattr(part, name, kept)
                        groups = kept.groups if isinstance(kept, OutFeatureGroups) else (kept,)
                        added += sum(g.kept_bytes for g in groups if isinstance(g, BlockFP8Weight))
        return added

    def new_pool(self, n_slots: int, max_seq_len: int, carry_rows: int = 0) -> SlotPool:
        return SlotPool(self.config, n_slots, max_seq_len, self.device, self.dtype, carry_rows)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, batch: RowBatch, pool: SlotPool, *, row_invariant: bool, last_only: bool = False,
                hidden_out: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [rows] int64 -> logits [rows, vocab] fp32 (or [sequences, vocab] with last_only).
        hidden_out: compute's.

        Commits every row: KV at the row's position, conv window and recurrent state advanced
        past the sequence's last row. Prefill runs this."""
        check_rows(tokens, batch, pool.max_seq_len, self.config.vocab_size)
        return self.compute(to_device(tokens, self.device), batch, pool, row_invariant=row_invariant, last_only=last_only, record=None,
                            hidden_out=hidden_out)

    def compute(self, tokens: torch.Tensor, batch: RowBatch, pool: SlotPool, *, row_invariant: bool, last_only: bool,
                record: VerifyRecord | None, logits_out: torch.Tensor | None = None,
                hidden_out: torch.Tensor | None = None, prompts: tuple[RowBatch, ...] = ()) -> torch.Tensor:
        """The forward itself, on checked device tokens: no host syncs, so a CUDA graph can capture it.
        record: a verify's (its Rollback says what the recurrent layers record; they fill it);
        None: every row is committed (prefill).
        logits_out: an optional fp32 [rows, vocab] buffer the logits are written into (the graphs'
        shared output; the same values: the LM head's output converted to fp32 once).
        hidden_out: an optional [rows, H] buffer (all rows, even with last_only) the final-normed
        hidden rows are copied into: the LM head's input, which an MTP head reads (verifier/model/mtp.py).
        prompts: groups of prompt rows that follow the verify's rows in `tokens` (a step that takes
        prompts in: residual_stream), each group what one prefill forward would hold; the logits are
        then the verify's rows, then each prompt sequence's last row, and hidden_out holds every row."""
        positions = batch.positions(self.device)
        h = self.embed[tokens] if self.parallel is None else self.parallel.embed(self.embed, tokens)
        x = residual_stream(self.config, self.blocks, pool.layers, h, self.final_norm, batch, positions,
                            row_invariant=row_invariant, record=record, parallel=self.parallel, prefill=record is None,
                            prompts=prompts)
        if hidden_out is not None:
            hidden_out.copy_(x)
        if prompts:  # the verify's rows, then each prompt sequence's last row
            assert not last_only and logits_out is None, "a step with prompts keeps its verify rows and writes no graph's buffer"
            ends = itertools.accumulate((n for group in prompts for n in group.counts), initial=batch.n_rows)
            head_rows = [*range(batch.n_rows), *(end - 1 for end in itertools.islice(ends, 1, None))]
            x = x.index_select(0, to_device(torch.tensor(head_rows, dtype=torch.int64), self.device))
            row_invariant = True  # each row's logits as its step or its prefill forward gives them: one row each
        if last_only:  # each sequence's last row, indexed on the device (a host index would be copied, and wait)
            x = x.index_select(0, batch.cu_rows(self.device)[1:] - 1)
        if self.parallel is None:
            return head_logits(x, self.lm_head, logits_out, row_invariant=row_invariant)
        # each rank's vocabulary columns [rows, cdiv(V, N)], gathered [rows, N * cdiv(V, N)] on every
        # rank and cut to the vocabulary: padding columns never leave here
        logits = self.parallel.gather_last(head_logits(x, self.lm_head, row_invariant=row_invariant))[:, :self.config.vocab_size]
        return logits if logits_out is None else logits_out.copy_(logits)

    def prefill(self, pool: SlotPool, slot: int, prompt: list[int], *, chunk: int = PREFILL_CHUNK, all_logits: bool = False,
                hidden_out: torch.Tensor | None = None, start: int = 0) -> torch.Tensor:
        """Consume `prompt` into `slot` from position `start` (0, or a boundary: a multiple of
        `chunk` up to which the slot holds the prompt already), `chunk` tokens per forward: every
        chunk starts at a multiple of `chunk` from position 0, whatever the prompt's length.
        hidden_out: an optional [len(prompt), H] buffer for every prompt row's final-normed hidden
        row (compute's; what an MTP head reads).

        Returns the logits of the last prompt token [vocab] (or of every token from `start` [len - start, vocab])."""
        if not start < len(prompt):
            raise ValueError(f"prefill needs a prompt token at or after start {start}, got {len(prompt)} tokens")
        if start % chunk:
            raise ValueError(f"prefill starts at a chunk boundary (a multiple of {chunk}), not at {start}")
        outs = []
        for begin in range(start, len(prompt), chunk):
            piece = prompt[begin : begin + chunk]
            batch = RowBatch(slots=(slot,), starts=(begin,), counts=(len(piece),))
            hidden = None if hidden_out is None else hidden_out[begin : begin + len(piece)]
            logits = self.forward(torch.tensor(piece, dtype=torch.int64), batch, pool, row_invariant=False, last_only=not all_logits,
                                  hidden_out=hidden)
            outs.append(logits)
        return torch.cat(outs) if all_logits else outs[-1][0]


def residual_stream(config: ModelConfig, blocks: list[Block], states: list, h: torch.Tensor, final_norm: torch.Tensor,
                    batch: RowBatch, positions: torch.Tensor, *, row_invariant: bool, record: VerifyRecord | None = None,
                    parallel: TensorParallel | None = None, prefill: bool = False, prompts: tuple[RowBatch, ...] = ()) -> torch.Tensor:
    """The stream h [rows, H] entering blocks[0] through every block (block i over states[i]) ->
    final_norm of the stream after the last block [rows, H]. The main model's blocks and an MTP
    head's layers (verifier/model/mtp.py) run this one loop.

    The residual stream's adds run fused into the norm that follows them: h + mixed with the
    block's post-norm, h + mlp with the next block's input norm (the final norm after the last);
    on CUDA a split-K output projection's reduce runs fused in there too (ops.linear's into_add_norm).
    parallel: each block's mixer and MLP outputs are this rank's partial sums [rows, H] (their
    output projections split by inputs), added across ranks in rank order before the add and norm
    (TensorParallel.sum: row-invariant, the same bits on every rank).
    prefill: the rows are a prompt's, every one committed (the attention layers and the experts may
    take prefill's kernels: verifier/model/layers/attend.py, mlp.py); an MTP head's rows never are.
    prompts: groups of prompt rows after the verify's `batch` in h (a step that takes prompts in,
    DESIGN.md section 9, "Prompts inside a step"): each mixer runs the verify's rows as the step
    alone would and each group's as its own prefill forward would (rows committed, prefill's
    kernels); the row-wise ops (norms, MLP) run over all rows at once with the kernels, so a
    step's weights are read once for both (MixedRows)."""
    eps, zero_centred = config.rms_norm_eps, config.zero_centred_norm
    if prompts:
        assert record is not None, "prompts join a verify"
        assert not prefill_kernels_differ(), "a step runs the experts with decode's launches, which a prefill forward does not take"
        row_invariant = MixedRows(batch.n_rows, tuple(group.n_rows for group in prompts))
        spans = row_invariant.spans

    def add_norm(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(a, b, weight, eps, zero_centred)

    def mix(block: Block, state, x: torch.Tensor, rows: RowBatch, at: torch.Tensor, invariant: bool, verify: VerifyRecord | None,
            index: int, of_prompts: bool):
        if isinstance(state, RecurrentState):  # a verify's record says what it keeps; without one, prefill commits
            mixed, layer_record = block.mixer.forward(x, rows, at, state, row_invariant=invariant,
                                                      rollback=None if verify is None else verify.rollback)
            if verify is not None:
                verify.layers[index] = layer_record
            return mixed
        return block.mixer.forward(x, rows, at, state, row_invariant=invariant, prefill=of_prompts)[0]

    x = each_row(lambda t: rms_norm(t, blocks[0].input_norm, eps, zero_centred), h, row_invariant=row_invariant)
    next_norms = [block.input_norm for block in blocks[1:]] + [final_norm]
    for index, (block, state, next_norm) in enumerate(zip(blocks, states, next_norms)):
        if not prompts:
            mixed = mix(block, state, x, batch, positions, row_invariant, record, index, prefill)
        else:  # the step's rows, then each group's, each finished (a split-K output's reduce) and stacked
            parts = [mix(block, state, x[: batch.n_rows], batch, positions, True, record, index, False)]
            for group, (begin, end) in zip(prompts, spans):
                parts.append(mix(block, state, x[begin:end], group, group.positions(x.device), False, None, index, True))
            mixed = torch.cat([part.finish() if isinstance(part, SplitSums) else part for part in parts])
        if parallel is not None:
            mixed = parallel.sum(mixed)
        h, x = each_row(lambda a, b: add_norm(a, b, block.post_norm), h, mixed, row_invariant=row_invariant)
        mlp_out = each_row(lambda t: block.mlp.forward(t, into_add_norm=True, prefill=prefill), x, row_invariant=row_invariant)
        if parallel is not None:
            mlp_out = parallel.sum(mlp_out)
        h, x = each_row(lambda a, b: add_norm(a, b, next_norm), h, mlp_out, row_invariant=row_invariant)
    return x


def load_model(model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               parallel: TensorParallel | None = None, fp8_reals: bool = True) -> HybridModel:
    """Read config.json and the safetensors weights of an HF checkpoint directory.
    parallel: load this rank's part of every split tensor (verifier/model/parallel/sharding.py);
    ValueError naming the field whose heads or sizes do not divide by the parallel size.
    fp8_reals: on CUDA in bf16, keep the dense block-FP8 weights' real values for steps of many
    rows (HybridModel.keep_fp8_reals; False: dequantize them each such GEMM, 2 bytes a weight element less)."""
    config = load_config(model_dir)
    if parallel is None:
        src = TensorSource(model_dir, device, dtype)
        model = HybridModel(config, src)
    else:
        whole, config = config, local_config(config, parallel.size)  # checked before any tensor is read
        model = HybridModel(config, ShardedSource(model_dir, device, dtype, whole, parallel), parallel)
    if fp8_reals and use_triton(model.embed) and dtype == torch.bfloat16:
        added = model.keep_fp8_reals()
        if added:
            log.info("kept the dense FP8 weights' real values for steps of many rows: %.2f GiB", added / 2**30)
    log.info("loaded %s: %d layers (%s), vocab %d, %s on %s", config.model_type, config.n_layers, "".join(k[0] for k in config.mixers), config.vocab_size, dtype, device)
    return model
