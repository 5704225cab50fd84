"""bench/fp8_real_size.py at --scale tiny on the CPU, end to end: the checkpoint it writes is the
published block-FP8 form (names, dtypes, scale shapes, quantization_config), the normal loader
serves it, and the correctness gate runs (36 verify rows bitwise equal to serial decode, and the
full batch of 64 sequences equal to each alone), and each figure's own floor is counted
(bench/step_floor.py). The full-size plan is checked against the published model's sizes without
writing it; decode_bytes and the floor's sizes and arithmetic are checked exactly on FP8 weights
kept as BlockFP8Weight. The MTP head the writer adds loads with load_mtp_head, its draft's floor
is counted by hand, the bench's drafts (bench/fp8_mtp.py) are the MTP proposer's, and its MTP part
writes its keys.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from bench import fp8_mtp
from bench import fp8_real_size as bench
from bench.gpu import decode_bytes, weight_bytes
from bench.step_floor import (DRAFT_CATEGORIES, DraftForward, SequenceStep, distinct_experts, draft_bytes, draft_sizes, mean_draft_floor,
                              model_sizes, recorded_routing, step_bytes, step_floor)
from hybrid_kernels.linear_fp8 import BlockScales, standard_scale_row
from verifier.model import RowBatch, load_model, load_mtp_head
from verifier.model.checkpoint import TensorSource
from verifier.model.config import MOE
from verifier.model.fp8 import FP8_DTYPE, BlockFP8Weight, OutFeatureGroups
from verifier.model.hf_config import config_from_dict, load_config, read_json_object
from verifier.model.hybrid import HybridModel
from verifier.model.mtp import MTPHead
from verifier.proposers.mtp import MTPProposer

# tensors the published files keep in their dtype (matched on the name's end)
KEPT_SUFFIXES = ("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight", "shared_expert_gate.weight", "in_proj_a.weight",
                 "in_proj_b.weight", "conv1d.weight", "layernorm.weight", "norm.weight", "dt_bias", "mtp.fc.weight",
                 "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")


def run_tiny(tmp_path: Path, experts: str, keep: bool, config: str = "qwen3.6-35b-a3b",
             extra: tuple[str, ...] = ()) -> tuple[dict, Path | None]:
    """main() at tiny scale on the CPU -> (results, the checkpoint folder when kept)."""
    work = tmp_path / "work"
    work.mkdir()
    result = bench.main(["--out", str(tmp_path / "out"), "--scale", "tiny", "--device", "cpu", "--workdir", str(work), "--config", config,
                         "--experts", experts, "--shard-gb", "0.0005", "--steps", "3", *extra] + (["--keep"] if keep else []))
    kept = list(work.glob(f"*/{config}-fp8"))
    return result, (kept[0] if kept else None)


def stored_bytes(t: bench.Planned, shape: tuple[int, ...] | None = None) -> int:
    """Bytes of a planned tensor (or one expert of its stack: shape) as the GPU holds it: an FP8
    weight [N, K] its values, block scales and int32 scale rows; any other in the model's bf16 (the
    loader casts the fp32 A_log too)."""
    shape = t.shape if shape is None else shape
    if t.fp8:
        return math.prod(shape) + 4 * math.prod(bench.FORMAT.scale_shape(shape)) + 4 * shape[-2]
    return 2 * math.prod(shape)


def check_floors(result: dict, top_k: int, n_experts: int) -> None:
    """Each figure's own floor (CPU: bytes only) is there and sane."""
    floors = result["step_floors"]
    assert list(floors) == [key for _, _, key in bench.FIGURES]
    for n, k, key in bench.FIGURES:
        f = floors[key]
        assert (f["rows"], f["sequences"], f["steps"]) == (n * (k + 1), n, 3)
        assert f["floor_ms"] is None and f["ratio"] is None  # no bandwidth measured on the CPU
        assert all(f["bytes"][c] > 0 for c in ("dense_weights", "embedding_rows", "routed_experts", "recurrent_state", "kv_read", "kv_written"))
        assert math.isclose(f["total_bytes"], sum(f["bytes"].values()))
        # a decode commits in its verify and its slot carries nothing (fresh, or after decodes): no stash
        assert (f["bytes"]["woa_stash"] > 0) == (k > 0), key
        d = f["distinct_experts"]
        assert d["of"] == n_experts and top_k <= d["min"] <= d["mean"] <= d["max"] <= n_experts, key
        assert len(d["per_layer"]) == 4  # every tiny layer is MoE
    # one row routes to exactly top_k distinct experts; 9 rows to at least that many in every layer
    decode, verify = floors["decode_ms_b1"]["distinct_experts"], floors[f"verify_k{bench.K}_ms_b1"]["distinct_experts"]
    assert decode["min"] == decode["max"] == top_k
    assert all(verify["per_layer"][layer] >= decode["per_layer"][layer] for layer in decode["per_layer"])
    # the same weights a step, whatever the rows; the routed experts' bytes grow with the experts routed to
    assert len({f["bytes"]["dense_weights"] for f in floors.values()}) == 1
    per_expert = {f["bytes"]["routed_experts"] / (f["distinct_experts"]["mean"] * 4) for f in floors.values()}
    assert max(per_expert) - min(per_expert) < 1e-6 * max(per_expert)


def check_mtp_draft(result: dict, top_k: int, n_experts: int) -> None:
    """The MTP part's keys (CPU: bytes only): per K, K forwards (the catch-up's 2 rows, then one row
    each), the catch-up routing to top_k .. 2 top_k experts and a one-row forward to exactly top_k."""
    mtp = result["mtp_draft"]
    assert (mtp["layers"], mtp["mlp"], mtp["catch_up_rows"]) == (1, MOE, 2) and mtp["weight_bytes"] > 0
    assert list(mtp["drafts"]) == [str(k) for k in fp8_mtp.MTP_KS]
    for k, figure in mtp["drafts"].items():
        k = int(k)
        assert figure["ms"] is None and figure["floor_ms"] is None and figure["ratio"] is None and figure["ratio_to_decode"] is None
        assert figure["kernel_breakdown"] is None and figure["steps"] == 3
        assert figure["forward_rows"] == [2] + [1] * (k - 1)
        assert list(figure["bytes"]) == list(DRAFT_CATEGORIES) and all(v > 0 for v in figure["bytes"].values())
        assert math.isclose(figure["total_bytes"], sum(figure["bytes"].values()))
        catch_up, *drafts = figure["distinct_experts"]["per_forward"]
        assert top_k <= catch_up <= min(2 * top_k, n_experts) and drafts == [top_k] * (k - 1)
        assert figure["distinct_experts"]["of"] == n_experts
    one = mtp["drafts"]["1"]["bytes"]
    assert mtp["drafts"]["4"]["bytes"]["lm_head"] == 4 * one["lm_head"]  # the full head once per drafted token


def stored_tensors(path: Path) -> dict[str, torch.Tensor]:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    tensors = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(str(path / file), framework="pt") as handle:
            for name in handle.keys():
                assert index["weight_map"][name] == file, name
                tensors[name] = handle.get_tensor(name)
    assert tensors.keys() == index["weight_map"].keys()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    return tensors


@pytest.mark.parametrize("experts", ["per-expert", "fused"])
def test_tiny_checkpoint_is_published_fp8_and_gates_green(tmp_path, experts):
    result, path = run_tiny(tmp_path, experts, keep=True)
    assert result["gate"] == "green" and result["bitexact_rows"] == "36/36"
    # the full batch: 64 decodes, then 64 verifies of K = 8, then mixed K; every row and layer state equal alone
    equal, checked = map(int, result["full_batch_rows"].split("/"))
    assert equal == checked > 0 and result["full_batch_first_difference"] is None
    assert result["full_batch_step_rows"][:2] == [bench.BATCH, bench.BATCH * (bench.K + 1)]
    assert result["logits_finite"] and result["logits_sane"]
    assert all(result[key] is None for key in bench.TIMED)  # the CPU reference is not timed
    text_sizes = bench.TINY_TEXT_SIZES
    check_floors(result, text_sizes["num_experts_per_tok"], text_sizes["num_experts"])
    check_mtp_draft(result, text_sizes["num_experts_per_tok"], text_sizes["num_experts"])
    assert result["mtp"] and bench.passed(result) and 0 < result["mtp_gb"] < result["checkpoint_gb"]
    import hybrid_kernels.moe_grouped as mg  # the launches by row count the run had, named in its file

    assert result["expert_launches"] == {"up_to_rows": mg.FEW_ROWS, "few_rows": mg.FEW_ROWS_LAUNCH,
                                         "from_rows": mg.MANY_ROWS, "many_rows": mg.MANY_ROWS_LAUNCH}
    written = json.loads(next((tmp_path / "out").glob("fp8_real_size_*.json")).read_text())
    assert written == json.loads(json.dumps(result))

    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128], "modules_to_not_convert": list(bench.KEPT_MODULES)}
    published = bench.published_configs()["qwen3.6-35b-a3b"]
    assert config["text_config"].keys() == published["text_config"].keys() and config.keys() - {"quantization_config"} == published.keys()
    text = config["text_config"]

    tensors = stored_tensors(path)
    assert len(set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
    assert all(n.startswith((bench.PREFIX, bench.MTP)) or n == "lm_head.weight" for n in tensors)
    scales = {n for n in tensors if n.endswith("_scale_inv")}
    for name, tensor in tensors.items():
        if name in scales:
            weight = tensors[name.removesuffix("_scale_inv")]
            assert weight.dtype == FP8_DTYPE and tensor.dtype == torch.float32, name
            *lead, n, k = weight.shape
            assert list(tensor.shape) == [*lead, math.ceil(n / 128), math.ceil(k / 128)], name
        elif name.endswith("A_log"):
            assert tensor.dtype == torch.float32
        elif name.endswith(KEPT_SUFFIXES):
            assert tensor.dtype == torch.bfloat16, name
        else:  # every other linear weight is block FP8
            assert tensor.dtype == FP8_DTYPE and name + "_scale_inv" in scales, name
    E, I, H = text["num_experts"], text["moe_intermediate_size"], text["hidden_size"]
    layer0 = bench.PREFIX + "layers.0.mlp.experts."
    experts_of_layer0 = {n: list(t.shape) for n, t in tensors.items() if n.startswith(layer0) and n not in scales}
    if experts == "fused":
        assert experts_of_layer0 == {bench.PREFIX + "layers.0.mlp.experts.gate_up_proj": [E, 2 * I, H],
                                     bench.PREFIX + "layers.0.mlp.experts.down_proj": [E, H, I]}
    else:
        assert len(experts_of_layer0) == 3 * E
        assert experts_of_layer0[bench.PREFIX + f"layers.0.mlp.experts.{E - 1}.up_proj.weight"] == [I, H]
        assert experts_of_layer0[bench.PREFIX + f"layers.0.mlp.experts.{E - 1}.down_proj.weight"] == [H, I]


def test_checkpoint_deleted_unless_kept(tmp_path):
    """Also the other published config (Qwen3.5-35B-A3B) at tiny scale, without the MTP head:
    written, gated, floors counted, no MTP draft."""
    result, path = run_tiny(tmp_path, "per-expert", keep=False, config="qwen3.5-35b-a3b", extra=("--no-mtp",))
    assert result["gate"] == "green" and path is None and result["config"] == "qwen3.5-35b-a3b"
    assert not result["mtp"] and result["mtp_gb"] == 0 and result["mtp_draft"] is None and bench.passed(result)
    assert not any((tmp_path / "work").iterdir())
    check_floors(result, bench.TINY_TEXT_SIZES["num_experts_per_tok"], bench.TINY_TEXT_SIZES["num_experts"])


def test_full_size_plan_is_the_published_model():
    config = config_from_dict(bench.checkpoint_config("qwen3.6-35b-a3b", "full"))
    plan = bench.plan_tensors(config, "fused")
    total, active = bench.params(plan, config)
    assert 34.5e9 < total < 35e9 and 3.3e9 < active < 3.6e9  # 35B-A3B without its vision tower and mtp layer
    by_name = {t.name: t for t in plan}
    gate_up = by_name[bench.PREFIX + "layers.39.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (256, 1024, 2048) and gate_up.fp8
    assert gate_up.nbytes == 256 * 1024 * 2048 + 4 * 256 * 8 * 16
    assert not by_name["lm_head.weight"].fp8 and not by_name[bench.PREFIX + "layers.0.linear_attn.in_proj_b.weight"].fp8
    assert by_name[bench.PREFIX + "layers.3.self_attn.q_proj.weight"].fp8
    assert 35e9 < sum(t.nbytes for t in plan) < 36.5e9  # fits the H200 machine's 64 GiB disk with room


def test_weight_bytes_of_fp8_weights():
    data = torch.zeros(300, 200, dtype=FP8_DTYPE)
    fp8 = BlockFP8Weight(data, BlockScales(torch.ones(3, 2), standard_scale_row(300, 128), 128), torch.bfloat16)
    assert weight_bytes(fp8) == 300 * 200 + 3 * 2 * 4 + 300 * 4  # fp8 values, fp32 scales, int32 scale rows
    kept = torch.zeros(7, 200, dtype=torch.bfloat16)
    assert weight_bytes(OutFeatureGroups((fp8, kept))) == weight_bytes(fp8) + 7 * 200 * 2


def test_decode_bytes_counts_fp8_weights_and_chosen_experts(tmp_path):
    """decode_bytes on a model whose FP8 weights stay BlockFP8Weight (as on CUDA) equals the sum
    over the plan: every weight but the embedding, top_k experts per layer, bf16 for kept ones."""
    config_json = bench.checkpoint_config("qwen3.6-35b-a3b", "tiny")
    plan = bench.write_checkpoint(tmp_path, config_json, "per-expert", 0, torch.device("cpu"), 10**9)
    model = HybridModel(load_config(tmp_path), TensorSource(tmp_path, "cpu", torch.bfloat16, keep_fp8=True))
    top_k = config_json["text_config"]["num_experts_per_tok"]
    expected = 0
    for t in plan:
        if t.name.endswith("embed_tokens.weight"):
            continue
        expected += top_k * stored_bytes(t, t.shape[1:]) if t.per_expert else stored_bytes(t)
    assert decode_bytes(model) == expected


def test_step_floor_counts_by_hand(tmp_path):
    """The floor's sizes of the tiny config in its GPU form (FP8 kept as BlockFP8Weight, bf16), and
    one step's bytes, against hand counts: exact integers."""
    config_json = bench.checkpoint_config("qwen3.6-35b-a3b", "tiny")
    plan = bench.write_checkpoint(tmp_path, config_json, "per-expert", 0, torch.device("cpu"), 10**9)
    model = HybridModel(load_config(tmp_path), TensorSource(tmp_path, "cpu", torch.bfloat16, keep_fp8=True))
    sizes = model_sizes(model, model.new_pool(4, 64, carry_rows=bench.K + 1))
    # every tensor but the embedding and the routed experts; one expert of layer 0 (every layer alike)
    assert sizes.dense == sum(stored_bytes(t) for t in plan if not t.per_expert and not t.name.endswith("embed_tokens.weight"))
    expert = sum(stored_bytes(t, t.shape[1:]) for t in plan if t.per_expert and ".layers.0." in t.name)
    # gate and up [160, 64]: 10240 fp8 + 2 x 1 block scales + 160 scale rows; down [64, 160]: 10240 + 1 x 2 + 64
    assert expert == 2 * (10240 + 2 * 4 + 160 * 4) + (10240 + 2 * 4 + 64 * 4) == 32280
    assert sizes.expert == {0: expert, 1: expert, 2: expert, 3: expert} and sizes.n_experts == 8
    assert sizes.embed_row == 64 * 2  # hidden 64 in bf16
    # 3 GDN layers: fp32 state 4 heads x 16 x 16, conv window (2 x 32 + 64 channels) x 3 in bf16
    assert sizes.recurrent_state == 3 * (4 * 16 * 16 * 4 + 128 * 3 * 2) == 14592
    # a stash row: per head key 16, value 16, decay 1, beta 1 in fp32
    assert sizes.stash_row == 3 * 4 * (16 + 16 + 1 + 1) * 4 == 1632
    # 1 attention layer: keys and values of 2 heads x 32 in bf16
    assert sizes.kv_position == 2 * 2 * 32 * 2 == 256

    # a verify of 9 rows at position 40 carrying 1 row and keeping 3, beside a decode at 7 carrying 2
    steps = [SequenceStep(40, 9, carried=1, kept=3), SequenceStep(7, 1, carried=2, kept=1)]
    distinct = {0: 3, 1: 8, 2: 5, 3: 2}
    assert step_bytes(sizes, steps, distinct) == {
        "dense_weights": sizes.dense,
        "embedding_rows": 10 * 128,
        "routed_experts": (3 + 8 + 5 + 2) * 32280,
        "recurrent_state": 2 * 2 * 14592,  # each sequence's state and window read and written
        "woa_stash": (9 + 2 * 3 + 1 + 2) * 1632,  # 9 written, 3 kept copied (read, written), 1 + 2 carried read
        "kv_read": (40 + 7) * 256,
        "kv_written": 10 * 256,
    }
    floor = step_floor(sizes, steps, distinct, bandwidth=2e12)
    assert floor["total_bytes"] == sum(step_bytes(sizes, steps, distinct).values())
    assert floor["floor_ms"] == floor["total_bytes"] / 2e12 * 1e3 and (floor["rows"], floor["sequences"]) == (10, 2)
    with pytest.raises(ValueError):  # a routing of other layers than the MoE ones
        step_bytes(sizes, steps, {0: 3})


def test_recorded_routing_counts_distinct_ids_and_unhooks():
    class Router:
        w_router = None
        cfg = SimpleNamespace(top_k=2)

        def route(self, x):
            return x, x.float()

    moe, dense = Router(), SimpleNamespace()
    model = SimpleNamespace(blocks=[SimpleNamespace(mlp=moe), SimpleNamespace(mlp=dense)])
    with recorded_routing(model) as routed:
        moe.route(torch.tensor([[1, 3], [3, 5]]))
        moe.route(torch.tensor([[5, 7]]))  # the CPU reference routes row by row: one call a row
    assert distinct_experts(routed) == {0: 4}
    assert "route" not in vars(moe) and moe.route(torch.tensor([[2, 4]]))[0].tolist() == [[2, 4]]


def test_same_seed_writes_the_same_bytes(tmp_path):
    config_json = bench.checkpoint_config("qwen3.6-35b-a3b", "tiny")
    for folder, seed in (("a", 0), ("b", 0), ("c", 1)):
        bench.write_checkpoint(tmp_path / folder, config_json, "fused", seed, torch.device("cpu"), 10**9)
    shard = "model-00001-of-00001.safetensors"
    assert (tmp_path / "a" / shard).read_bytes() == (tmp_path / "b" / shard).read_bytes()
    assert (tmp_path / "a" / shard).read_bytes() != (tmp_path / "c" / shard).read_bytes()


def test_own_floors_with_a_bandwidth(tmp_path, monkeypatch):
    """The CUDA branch of own_floors on the CPU: floor_ms is the mean bytes over the bandwidth, and
    each figure's last step goes through the kernel table (faked here: the profiler needs CUDA)."""
    bench.write_checkpoint(tmp_path, bench.checkpoint_config("qwen3.6-35b-a3b", "tiny"), "fused", 0, torch.device("cpu"), 10**9)
    profiled = []

    def fake_table(fn):
        fn()
        profiled.append(True)
        return {"launches": 1, "device_ms": 0.5, "top": []}

    monkeypatch.setattr(bench, "kernel_table", fake_table)
    out = bench.own_floors(load_model(tmp_path, "cpu", torch.float32), steps=1, bandwidth=1e9)
    assert len(profiled) == len(bench.FIGURES) and list(out["kernel_breakdowns"]) == [key for _, _, key in bench.FIGURES]
    for floor in out["step_floors"].values():
        assert floor["steps"] == 1 and floor["floor_ms"] == floor["floor_ms_min"] == floor["total_bytes"] / 1e9 * 1e3


def write_tiny_mtp(path: Path, experts: str = "per-expert") -> list[bench.Planned]:
    return bench.write_checkpoint(path, bench.checkpoint_config("qwen3.6-35b-a3b", "tiny"), experts, 0, torch.device("cpu"), 10**9,
                                  mtp=True)


@pytest.mark.parametrize("experts", ["per-expert", "fused"])
def test_mtp_head_is_written_in_the_published_layout_and_loads(tmp_path, experts):
    """The head's layer is stored as the main attention layer (3) is: the same names under
    mtp.layers.0, the same dtypes (FP8 beside weight_scale_inv, or kept); fc and the norms in bf16.
    load_model skips it; load_mtp_head reads it: one layer with the sparse MLP, finite logits."""
    plan = write_tiny_mtp(tmp_path, experts)
    tensors = stored_tensors(tmp_path)
    attention = bench.PREFIX + "layers.3."
    main_layer = {n.removeprefix(attention): t.dtype for n, t in tensors.items() if n.startswith(attention)}
    mtp_layer = {n.removeprefix("mtp.layers.0."): t.dtype for n, t in tensors.items() if n.startswith("mtp.layers.0.")}
    assert mtp_layer == main_layer and any(n.endswith("weight_scale_inv") for n in mtp_layer)
    assert "self_attn.q_proj.weight" in mtp_layer and "mlp.gate.weight" in mtp_layer
    rest = {n: t for n, t in tensors.items() if n.startswith("mtp.") and not n.startswith("mtp.layers.")}
    assert {n: (t.dtype, list(t.shape)) for n, t in rest.items()} == {
        "mtp.fc.weight": (torch.bfloat16, [64, 128]), "mtp.norm.weight": (torch.bfloat16, [64]),
        "mtp.pre_fc_norm_embedding.weight": (torch.bfloat16, [64]), "mtp.pre_fc_norm_hidden.weight": (torch.bfloat16, [64])}
    assert json.loads((tmp_path / "config.json").read_text())["text_config"]["mtp_num_hidden_layers"] == 1
    # the text model's parameters as without the head
    config = config_from_dict(bench.checkpoint_config("qwen3.6-35b-a3b", "tiny"))
    assert bench.params(plan, config) == bench.params(bench.plan_tensors(config, experts), config)

    model = load_model(tmp_path, "cpu", torch.float32)
    head = load_mtp_head(tmp_path, model)
    assert head is not None and head.n_layers == 1 and head.config.mlps == (MOE,)
    pool = head.new_pool(1, 16)
    slot = pool.admit()
    batch = RowBatch(slots=(slot,), starts=(0,), counts=(3,))
    out, logits = head.forward(torch.tensor([5, 6, 7]), torch.randn(3, 64), batch, pool, row_invariant=True)
    assert out.shape == (3, 64) and logits.shape == (3, 1024) and bool(torch.isfinite(logits).all())


def test_the_main_tensors_are_the_same_with_the_mtp_head(tmp_path):
    """The head's tensors come last and draw from their own generators: the text model's bytes are unchanged."""
    config_json = bench.checkpoint_config("qwen3.6-35b-a3b", "tiny")
    bench.write_checkpoint(tmp_path / "plain", config_json, "fused", 0, torch.device("cpu"), 10**5)
    write_tiny_mtp(tmp_path / "mtp", "fused")
    plain, with_mtp = stored_tensors(tmp_path / "plain"), stored_tensors(tmp_path / "mtp")
    assert with_mtp.keys() - plain.keys() == {n for n in with_mtp if n.startswith("mtp.")} != set()
    assert all(torch.equal(plain[n].view(torch.uint8), with_mtp[n].view(torch.uint8)) for n in plain)


def test_full_size_mtp_plan():
    config = config_from_dict(bench.checkpoint_config("qwen3.6-35b-a3b", "full"))
    plan = bench.plan_tensors(config, "per-expert", mtp=True)
    mtp = {t.name: t for t in plan if t.name.startswith("mtp.")}
    assert mtp["mtp.layers.0.mlp.experts.{e}.down_proj.weight"].shape == (256, 2048, 512)
    assert mtp["mtp.layers.0.mlp.experts.{e}.down_proj.weight"].fp8 and mtp["mtp.layers.0.self_attn.q_proj.weight"].fp8
    assert not mtp["mtp.fc.weight"].fp8 and mtp["mtp.fc.weight"].shape == (2048, 4096)
    assert not mtp["mtp.layers.0.mlp.gate.weight"].fp8 and not mtp["mtp.layers.0.mlp.shared_expert_gate.weight"].fp8
    assert 0.8e9 < sum(t.nbytes for t in mtp.values()) < 0.9e9  # 256 experts of 3 MiB in FP8, the attention, fc in bf16
    assert bench.params(plan, config) == bench.params(bench.plan_tensors(config, "per-expert"), config)


def test_draft_floor_counts_by_hand(tmp_path):
    """An MTP draft's floor on the tiny head in its GPU form (FP8 kept as BlockFP8Weight, bf16),
    against hand counts: exact integers."""
    plan = write_tiny_mtp(tmp_path)
    model = HybridModel(load_config(tmp_path), TensorSource(tmp_path, "cpu", torch.bfloat16, keep_fp8=True))
    head = MTPHead.load(model, TensorSource(tmp_path, "cpu", torch.bfloat16, keep_fp8=True, mtp=True),
                        read_json_object(tmp_path / "config.json"))
    sizes = draft_sizes(head, head.new_pool(1, 64))
    # FP8 [N, K]: N * K values, 4 bytes a 128 x 128 block scale, 4 bytes a scale row (N)
    attention = (256 * 64 + 2 * 4 + 256 * 4) + 2 * (64 * 64 + 4 + 64 * 4) + (64 * 128 + 4 + 64 * 4)  # q (with its gate), k, v, o
    norms = 2 * 32 * 2 + 2 * 64 * 2  # q_norm, k_norm; input and post-attention norms (bf16)
    router_and_gate = 8 * 64 * 2 + 64 * 2
    # the shared expert, as wide as the experts, folded in as one more: gate and up [160, 64] (2 scale rows), down [64, 160]
    shared = 2 * (160 * 64 + 2 * 4 + 160 * 4) + (64 * 160 + 2 * 4 + 64 * 4)
    assert shared == sizes.expert
    assert sizes.mtp_layer == attention + norms + router_and_gate + shared == 68396
    assert sizes.mtp_layer == sum(stored_bytes(t) for t in plan if t.name.startswith("mtp.layers.0.") and not t.per_expert)
    assert sizes.fc_and_norms == 64 * 128 * 2 + 3 * 64 * 2 == 16768  # fc [64, 128] in bf16; the pre-fc norms, the final norm
    assert (sizes.lm_head, sizes.embed_row, sizes.expert, sizes.n_experts) == (1024 * 64 * 2, 64 * 2, 32280, 8)
    assert sizes.kv_position == 2 * 2 * 32 * 2  # keys and values of 2 heads x 32 in bf16

    # K = 3 after a verify that accepted one draft: the catch-up over positions 40, 41, then drafts at 42, 43
    forwards = [DraftForward(40, 2, 3), DraftForward(42, 1, 2), DraftForward(43, 1, 2)]
    assert draft_bytes(sizes, forwards) == {
        "mtp_layer": 3 * 68396,
        "fc_and_norms": 3 * 16768,
        "lm_head": 3 * 131072,  # the full head once per drafted token
        "embedding_rows": 4 * 128,
        "routed_experts": (3 + 2 + 2) * 32280,
        "kv_read": (40 + 42 + 43) * 256,
        "kv_written": 4 * 256,
    }
    other = [DraftForward(50, 2, 4), DraftForward(52, 1, 2), DraftForward(53, 1, 2)]
    floor = mean_draft_floor([forwards, other], sizes, bandwidth=1e9)
    assert floor["bytes"]["routed_experts"] == 7.5 * 32280 and floor["bytes"]["kv_read"] == 140 * 256
    assert floor["floor_ms"] == floor["total_bytes"] / 1e9 * 1e3 and floor["total_bytes"] == sum(floor["bytes"].values())
    assert floor["distinct_experts"] == {"per_forward": [3.5, 2.0, 2.0], "of": 8} and floor["forward_rows"] == [2, 1, 1]


def test_the_timed_drafts_are_the_mtp_proposers(tmp_path):
    """MTPDrafts steps as verifier/proposers/mtp.py proposes: the same drafts, step after step, fed
    the same hidden rows and tokens through the proposer's public calls."""
    write_tiny_mtp(tmp_path)
    model = load_model(tmp_path, "cpu", torch.float32)
    head = load_mtp_head(tmp_path, model)
    hidden = fp8_mtp.prompt_hidden(model)
    n, k, length = hidden.shape[0], 4, hidden.shape[0] + 12
    run = fp8_mtp.MTPDrafts(head, hidden, length)
    proposer = MTPProposer(head, length)
    proposer.begin(hidden)
    proposer.propose(run.tokens[: n + 1], k)  # the first proposal: the prompt's rows (MTPDrafts fed them when made)
    drafted = set()
    for _ in range(4):
        drafts = run.step(k)
        proposer.observe(run.hidden[run.p - 2 : run.p])  # one accepted draft and the bonus consumed
        assert proposer.propose(run.tokens[: run.p + 1], k) == drafts and len(drafts) == k
        drafted.update(drafts)
    assert len(drafted) > 1


def test_mtp_draft_with_a_bandwidth(tmp_path, monkeypatch):
    """The CUDA branch of mtp_draft on the CPU, its timing and profiler faked: ms, ratio to its own
    floor and to a decode step, and each K's last step through the kernel table."""
    write_tiny_mtp(tmp_path)
    model = load_model(tmp_path, "cpu", torch.float32)
    profiled = []

    def fake_median(fn, repeats, warmup):
        for _ in range(warmup + repeats):
            fn()
        return 3.0

    def fake_table(fn):
        fn()
        profiled.append(True)
        return {"launches": 1, "device_ms": 0.5, "top": []}

    monkeypatch.setattr(fp8_mtp, "median_ms", fake_median)
    monkeypatch.setattr(fp8_mtp, "kernel_table", fake_table)
    out = fp8_mtp.mtp_draft(tmp_path, model, steps=2, bandwidth=1e9, decode_ms=6.0, warmup=bench.WARMUP, log=bench.log)
    assert len(profiled) == len(fp8_mtp.MTP_KS)
    for figure in out["drafts"].values():
        assert figure["floor_ms"] == figure["total_bytes"] / 1e9 * 1e3 and figure["ratio"] == 3.0 / figure["floor_ms"]
        assert figure["ratio_to_decode"] == 0.5 and figure["kernel_breakdown"]["launches"] == 1 and figure["steps"] == 2
        assert figure["ms"] == figure["ms_eager"] == 3.0  # the graphed chain's and the eager forwards', side by side


def test_the_chained_drafts_are_the_eager_forwards_drafts(tmp_path):
    """bench.fp8_mtp times the in-process path (the MTP chain) beside the eager forwards: the same drafts."""
    write_tiny_mtp(tmp_path)
    model = load_model(tmp_path, "cpu", torch.float32)
    head = load_mtp_head(tmp_path, model)
    hidden = fp8_mtp.prompt_hidden(model)
    length = hidden.shape[0] + 40
    eager, chained = fp8_mtp.MTPDrafts(head, hidden, length), fp8_mtp.ChainDrafts(head, hidden, length)
    for k in (1, 3, 4, 2):
        assert chained.step(k) == eager.step(k), k


def test_a_failed_mtp_draft_keeps_the_figures_and_fails_the_run(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no kernel")

    monkeypatch.setattr(bench, "mtp_draft", broken)
    result, _ = run_tiny(tmp_path, "fused", keep=False)
    assert result["gate"] == "green" and result["step_floors"] and result["mtp_draft"] == {"error": "RuntimeError: no kernel"}
    assert not bench.passed(result)


def test_the_mtp_module_stands_alone():
    """bench/fp8_mtp.py imports without bench/fp8_real_size.py (which imports it): no import cycle."""
    code = "import sys, bench.fp8_mtp; assert 'bench.fp8_real_size' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])
