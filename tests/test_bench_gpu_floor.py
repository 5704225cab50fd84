"""bench/gpu.py's batch HBM floor: what a batch decode must move besides the weights, counted from
a real pool against the model's configuration by hand."""

import pytest
import torch

from bench.gpu import batch_state_bytes
from verifier.model.config import ATTENTION, GDN, KDA
from verifier.model.state import SlotPool


@pytest.mark.parametrize("spec", ["qwen3_5_text", "kimi_linear"])
def test_batch_state_bytes_counts_states_windows_and_the_kv_prefix(load_target, spec):
    model = load_target(spec)
    cfg = model.config
    pool = SlotPool(cfg, 4, 32, "cpu", torch.bfloat16, carry_rows=3)  # carried rows are not read by a decode
    per_sequence = 0
    for kind in cfg.mixers:
        if kind == GDN:
            g = cfg.gdn
            per_sequence += 2 * (g.n_v_heads * g.d_k * g.d_v * 4 + g.conv_dim * (g.conv_width - 1) * 2)
        elif kind == KDA:
            k = cfg.kda
            per_sequence += 2 * (k.n_heads * k.head_dim * k.head_dim * 4 + k.conv_dim * (k.conv_width - 1) * 2)
        elif kind == ATTENTION:
            a = cfg.attention
            per_sequence += (10 + 2) * a.n_kv_heads * a.head_dim * 2 * 2  # positions 0..10 read, one written
        else:
            m = cfg.mla
            per_sequence += (10 + 2) * m.n_heads * (m.qk_head_dim + m.v_head_dim) * 2
    assert per_sequence > 0
    assert batch_state_bytes(pool, 3, 10) == 3 * per_sequence
    assert batch_state_bytes(pool, 0, 10) == 0
