"""The checkpoint's own multi-token-prediction (MTP) head (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, Qwen3.6).
The design in full: DESIGN.md section 9, "The MTP head".
"""

from __future__ import annotations

import logging
import re
from dataclasses import replace
from pathlib import Path

import torch

from .checkpoint import CheckpointError, TensorSource
from .config import ATTENTION, DENSE, MOE
from .hf_config import read_json_object
from .hybrid import Block, HybridModel, residual_stream
from .ops import each_row, head_logits, linear, rms_norm
from .rows import RowBatch, check_rows
from .state import SlotPool

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^(model\.)?mtp\.layers\.(\d+)\.")  # a stored name, either spelling
# config.json's MTP layer count: Qwen3.5's field, then the one vLLM reads for Qwen3-Next
_COUNT_FIELDS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")


class MTPHead:
    def __init__(self, model: HybridModel, src: TensorSource, n_layers: int):
        config = model.config
        if config.attention is None:
            raise CheckpointError(f"a {config.model_type} model has no gated full attention, so no MTP layer of the "
                                  "published Qwen layout; its mtp.* tensors cannot be read")
        H = config.hidden_size
        self.device, self.dtype = model.device, model.dtype
        self.vocab_size = config.vocab_size
        self.embed, self.lm_head = model.embed, model.lm_head  # shared with the main model
        self.norm_embedding = src.take("mtp.pre_fc_norm_embedding.weight", (H,))
        self.norm_hidden = src.take("mtp.pre_fc_norm_hidden.weight", (H,))
        self.w_fc = src.take("mtp.fc.weight", (H, 2 * H))
        mlps = tuple(MOE if src.has(f"mtp.layers.{j}.mlp.gate.weight") else DENSE for j in range(n_layers))
        if MOE in mlps and config.moe is None:
            raise CheckpointError(f"tensor {src.stored_name('mtp.layers.0.mlp.gate.weight')!r}: an MTP layer with a router, "
                                  f"but the {config.model_type} config has no experts")
        # The MTP layers as a model config of their own: full attention each, so the same Block
        # and SlotPool serve them.
        self.config = replace(config, mixers=(ATTENTION,) * n_layers, mlps=mlps)
        self.layers = [Block(self.config, src, j, prefix=f"mtp.layers.{j}") for j in range(n_layers)]
        self.final_norm = src.take("mtp.norm.weight", (H,))
        leftovers = src.leftovers()
        if leftovers:
            shown = ", ".join(repr(n) for n in leftovers[:8])
            raise CheckpointError(f"unexpected MTP tensor(s) for {n_layers} MTP layer(s) of this config: {shown}")

    @classmethod
    def load(cls, model: HybridModel, src: TensorSource, config_json: dict) -> "MTPHead | None":
        """src: a TensorSource opened with mtp=True; config_json: the checkpoint's config.json.
        None when the checkpoint has no mtp.* tensors (a config that still counts MTP layers then
        describes tensors a converter dropped); CheckpointError when it has some but not all."""
        stored = src.leftovers()
        if not stored:
            return None
        text = config_json["text_config"] if isinstance(config_json.get("text_config"), dict) else config_json
        if text.get("mtp_use_dedicated_embeddings"):
            raise CheckpointError("config.json: mtp_use_dedicated_embeddings = true is not supported (the published "
                                  "checkpoints share the main model's embedding with the MTP head)")
        field = next((f for f in _COUNT_FIELDS if text.get(f) is not None), None)
        if field is not None:
            n_layers = int(text[field])
            if n_layers < 1:
                raise CheckpointError(f"config.json: {field} = {text[field]!r}, but the checkpoint holds MTP tensors "
                                      f"({', '.join(repr(n) for n in stored[:3])}, ...)")
        else:
            indices = {int(m.group(2)) for m in map(_LAYER.match, stored) if m}
            n_layers = 1 + max(indices, default=0)
        return cls(model, src, n_layers)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def new_pool(self, n_slots: int, max_seq_len: int) -> SlotPool:
        """The MTP layers' KV rows: slot s serves the main pool's slot s (the caller pairs them)."""
        return SlotPool(self.config, n_slots, max_seq_len, self.device, self.dtype)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, batch: RowBatch, pool: SlotPool, *, row_invariant: bool,
                step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [rows] int64, hidden [rows, H] (DESIGN.md section 9, "The MTP head") -> (out [rows, H], the final-normed
        hidden a further step feeds back; logits [rows, vocab] fp32). Runs MTP layer step % n_layers
        and writes each row's K/V at its position in its slot of that layer's pool."""
        check_rows(tokens, batch, pool.max_seq_len, self.vocab_size)
        assert hidden.shape == (batch.n_rows, self.config.hidden_size), \
            f"hidden has shape {list(hidden.shape)}, expected [{batch.n_rows}, {self.config.hidden_size}]"
        tokens, hidden = tokens.to(self.device), hidden.to(device=self.device, dtype=self.dtype)
        return self.compute(tokens, hidden, batch, pool, row_invariant=row_invariant, step=step)

    def compute(self, tokens: torch.Tensor, hidden: torch.Tensor, batch: RowBatch, pool: SlotPool, *,
                row_invariant: bool, step: int = 0, logits_out: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward on checked device inputs: no host syncs, so a CUDA graph can capture it (the MTP
        chain: verifier/proposers/mtp_chain.py). logits_out: an optional fp32 [rows, vocab] buffer."""
        j = step % self.n_layers
        x = each_row(self._fuse, self.embed[tokens], hidden, row_invariant=row_invariant)
        out = residual_stream(self.config, [self.layers[j]], [pool.layers[j]], x, self.final_norm, batch,
                              batch.positions(self.device), row_invariant=row_invariant)
        return out, head_logits(out, self.lm_head, logits_out, row_invariant=row_invariant)

    def _fuse(self, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[n, H] each -> fc(cat(norm_emb(embedded), norm_hidden(hidden))) [n, H]."""
        eps, zero_centred = self.config.rms_norm_eps, self.config.zero_centred_norm
        both = torch.cat((rms_norm(embedded, self.norm_embedding, eps, zero_centred),
                          rms_norm(hidden, self.norm_hidden, eps, zero_centred)), dim=-1)
        return linear(both, self.w_fc)


def load_mtp_head(model_dir: str | Path, model: HybridModel) -> MTPHead | None:
    """The MTP head of the checkpoint `model` was loaded from (on its device, in its dtype), or None
    when the checkpoint has none. Opt in: load_model skips the mtp.* tensors."""
    if getattr(model, "parallel", None) is not None:
        raise CheckpointError(f"the MTP head is not split across tensor-parallel ranks yet ({model.parallel.size} ranks); "
                              "draft another way")
    src = TensorSource(model_dir, model.device, model.dtype, mtp=True)
    head = MTPHead.load(model, src, read_json_object(Path(model_dir) / "config.json"))
    if head is not None:
        log.info("loaded the MTP head: %d layer(s) (%s MLP)", head.n_layers, "/".join(head.config.mlps))
    return head
