"""`python -m verifier check --tensor-parallel N` on the CPU (gloo): the whole check on N ranks,
comparing the N-rank engine with itself. It passes on a tiny TP preset and records the size; a
difference on one rank only (a broken rank's rows, or its state) reaches rank 0's report without
the ranks parting ways; a size that does not divide is named before any weight is read; a rank
that fails is an error with its own exit status, not a hang.

The checkpoint: presets/tiny.py's qwen3_5_moe_tp (GDN, gated attention, fused experts; heads that
divide by 2 and 3). Starting ranks is slow (each imports torch), so each test starts them once.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from hybrid_kernels import delta_rule
from verifier import cli
from verifier.check import checks as check_module
from verifier.check import parallel as check_parallel
from verifier.check.checks import CheckSettings
from verifier.check.report import RANK_FAILED, check_report
from verifier.model import load_model
from verifier.model.parallel import ParallelError, TensorParallel, run_parallel

MAX_K, NEW_TOKENS, SEQUENCES = 3, 5, 5
SMALL = ["--max-k", str(MAX_K), "--new-tokens", str(NEW_TOKENS), "--prompt-len", "6", "--sequences", str(SEQUENCES)]
SETTINGS = CheckSettings(MAX_K, 6, NEW_TOKENS, SEQUENCES, 0)
PRESET = "qwen3_5_moe_tp"
COUNTS = ("rows_checked", "states_checked")


def _counts(report: dict) -> dict:
    """What was compared, check by check (not whether it was equal)."""
    return {c["name"]: ({k: c[k] for k in COUNTS}, {kind: n["checked"] for kind, n in c["per_layer_kind"].items()})
            for c in report["checks"]}


# ---- what rank 1 breaks (module-level: the spawned ranks import them) ----

def _nudge_multi_row_delta_rule() -> None:
    """The delta rule's reference nudges its outputs when a call carries more than one row: this
    rank's verify rows then depend on how many rows share a call; serial decode has one a call."""
    honest = delta_rule.delta_rule_verify_ref

    def batch_dependent(state, query, *rest, **kwargs):
        out = honest(state, query, *rest, **kwargs)
        return out if query.shape[0] == 1 else out * (1 + 2**-20)

    delta_rule.delta_rule_verify_ref = batch_dependent


def _perturb_batched_engine_states() -> None:
    """The full batch's engine (the first with more than one slot) reports layer 0's state off by
    one on this rank: its rows stay equal, only this rank's state comparisons differ."""
    honest, batched = check_module.slot_state, []

    def perturbed(engine, slot, position):
        states = honest(engine, slot, position)
        if engine.pool.n_slots > 1 and not batched:
            batched.append(engine)
        if batched and engine is batched[0]:
            states[0].tensors[0] = states[0].tensors[0] + 1
        return states

    check_module.slot_state = perturbed


def _broken_on_rank_1(parallel: TensorParallel, model_dir: str) -> dict:
    """The command's own rank function run twice, rank 1 broken each time (rank 0 honest):
    breakage -> rank 0's report. One start of the ranks for both."""
    reports = {}
    for breakage, breaks in (("states", _perturb_batched_engine_states), ("rows", _nudge_multi_row_delta_rule)):
        honest = check_module.slot_state, delta_rule.delta_rule_verify_ref
        if parallel.rank == 1:
            breaks()
        reports[breakage] = check_parallel._check_on_rank(parallel, Path(model_dir), "cpu", "float32", SETTINGS)
        check_module.slot_state, delta_rule.delta_rule_verify_ref = honest
    return reports


# ---- the tests ----

def test_check_on_two_ranks_passes_and_compares_what_one_process_does(hf_checkpoint, tmp_path, capsys):
    model_dir = hf_checkpoint(PRESET)
    report_path = tmp_path / "report.json"
    code = cli.main(["check", "--model", str(model_dir), *SMALL, "--tensor-parallel", "2", "--json", str(report_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads(report_path.read_text())
    assert report["tensor_parallel"] == 2 and report["passed"] and report["first_difference"] is None
    assert report["rows_equal"] == report["rows_checked"] > 0 and report["states_equal"] == report["states_checked"] > 0
    assert all(c["passed"] for c in report["checks"])
    assert "2 tensor-parallel ranks" in out.splitlines()[1] and out.splitlines()[-1].startswith("PASS: ")
    # the ranks compare exactly what one process compares: agreeing on each verdict drops no stream
    alone = check_report(load_model(model_dir), model_dir, SETTINGS, "cpu", "float32", show_progress=False)
    assert alone["tensor_parallel"] == 1 and alone["passed"]
    assert _counts(report) == _counts(alone)


def test_a_difference_on_one_rank_reaches_the_report(hf_checkpoint):
    reports = run_parallel(_broken_on_rank_1, 2, str(hf_checkpoint(PRESET)), timeout_s=120)
    # rank 1's verify rows depend on the rows per call: the first verify differs, in a GDN mixer,
    # on rank 0's report too (its own rows were honest until rank 1's partial sums reached them)
    rows = reports["rows"]
    assert not rows["passed"] and rows["tensor_parallel"] == 2
    first = rows["first_difference"]
    assert first["check"] == "verify_vs_serial" and first["where"].startswith("K=1 ") and "gdn mixer" in first["where"]
    assert 0 < first["max_abs_diff"] < 1e-3
    # rank 1's full-batch states are off while every row stays equal: only that check fails, on its states
    states = reports["states"]
    checks = {c["name"]: c for c in states["checks"]}
    assert [name for name, c in checks.items() if not c["passed"]] == ["full_batch_vs_alone"]
    full = checks["full_batch_vs_alone"]
    assert full["rows_equal"] == full["rows_checked"] > 0 and full["states_equal"] < full["states_checked"]
    assert abs(states["first_difference"]["max_abs_diff"] - 1) < 1e-3  # the + 1, rounded in the state's dtype
    assert states["rows_equal"] == states["rows_checked"] and not states["passed"]


def test_a_size_that_does_not_divide_exits_2_before_any_weight_is_read(hf_checkpoint, tmp_path, capsys):
    config_only = tmp_path / "config_only"  # no weights: a run that read any would fail otherwise
    config_only.mkdir()
    shutil.copy(hf_checkpoint("qwen3_next_tp") / "config.json", config_only)
    assert cli.main(["check", "--model", str(config_only), *SMALL, "--tensor-parallel", "4"]) == 2
    err = capsys.readouterr().err
    assert "--tensor-parallel 4" in err and "attention n_kv_heads" in err and "6 is not divisible by 4" in err
    # a size that divides starts the ranks; their missing weights are a bad --model, naming the rank
    assert cli.main(["check", "--model", str(config_only), *SMALL, "--tensor-parallel", "2"]) == 2
    err = capsys.readouterr().err
    assert "--model" in err and "neither model.safetensors" in err and "of 2)" in err


def test_a_rank_that_fails_in_the_check_exits_with_its_own_status(hf_checkpoint, tmp_path, capsys, monkeypatch):
    """A failure past loading is neither a difference (1) nor bad arguments (2): the failing rank named."""
    def failing(*args, **kwargs):
        raise ParallelError("rank 1 of 2 failed: RuntimeError: a collective broke", 1, RuntimeError("a collective broke"),
                            "Traceback (most recent call last): ...")

    monkeypatch.setattr(check_parallel, "run_parallel", failing)
    code = cli.main(["check", "--model", str(hf_checkpoint(PRESET)), *SMALL, "--tensor-parallel", "2",
                     "--json", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert code == RANK_FAILED == 3
    assert "rank 1 of 2 failed: RuntimeError: a collective broke" in err and "Traceback" in err
    assert not (tmp_path / "r.json").exists()


def test_agree_takes_every_ranks_verdict():
    """One process (None or size 1): the verdicts as given, no collective."""
    from verifier.check.results import agree

    for parallel in (None, TensorParallel(0, 1)):
        assert agree(parallel, [True, False], [0.0, 2.5]) == ([True, False], [0.0, 2.5])
