"""`python -m verifier check`: it passes on every tiny family, fails on a planted row-invariance
bug naming the check and the layer, and refuses bad arguments with status 2."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_kernels import delta_rule
from presets.tiny import SPECS
from verifier import cli
from verifier.arguments import flags_without_stated_default
from verifier.check import add_check_parser

REPO = Path(__file__).resolve().parent.parent
MAX_K, NEW_TOKENS = 3, 5
SEQUENCES = 5
SMALL = ["--max-k", str(MAX_K), "--new-tokens", str(NEW_TOKENS), "--prompt-len", "6", "--sequences", str(SEQUENCES)]
CHECK_NAMES = ["verify_vs_serial", "rollback_state", "full_batch_vs_alone", "streams_vs_plain", "prefix_cache_vs_cold",
               "prompts_in_steps"]


def _check(model_dir, tmp_path, *extra) -> tuple[int, dict]:
    """Run the command in this process -> (exit status, the --json report)."""
    report = tmp_path / "report.json"
    code = cli.main(["check", "--model", str(model_dir), *SMALL, "--json", str(report), *extra])
    return code, json.loads(report.read_text())


@pytest.mark.parametrize("name", sorted(SPECS))
def test_check_passes_on_every_family(hf_checkpoint, tmp_path, capsys, name):
    code, report = _check(hf_checkpoint(name), tmp_path)
    out = capsys.readouterr().out
    assert code == 0, out
    assert report["passed"] and report["first_difference"] is None
    assert report["rows_equal"] == report["rows_checked"] > 0
    assert report["states_equal"] == report["states_checked"] > 0
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == CHECK_NAMES
    assert all(c["passed"] and c["rows_equal"] == c["rows_checked"] > 0 for c in checks.values())
    assert sum(c["rows_checked"] for c in checks.values()) == report["rows_checked"]
    # every stream of K = 1..3 and 3 draft kinds emits NEW_TOKENS - 1 verify rows; the streams check
    # compares 2 samplings x 3 drafters x K in {2, 3} streams of NEW_TOKENS rows
    assert checks["verify_vs_serial"]["rows_checked"] == MAX_K * 3 * (NEW_TOKENS - 1)
    assert checks["streams_vs_plain"]["rows_checked"] == 2 * 3 * 2 * NEW_TOKENS
    # 2 modes x 3 prompts: the first row, every layer's state after the open, a stream of NEW_TOKENS rows
    assert checks["prefix_cache_vs_cold"]["rows_checked"] == 2 * 3 * (1 + NEW_TOKENS)
    assert checks["prefix_cache_vs_cold"]["states_checked"] == 2 * 3 * report["model"]["layers"]
    # every layer of the model is compared after every verify and the decode after it, in both modes
    n_layers = report["model"]["layers"]
    assert checks["rollback_state"]["states_checked"] == 2 * MAX_K * 2 * n_layers
    mixers, mlps = report["model"]["mixers"], report["model"]["mlps"]
    per_kind = checks["verify_vs_serial"]["per_layer_kind"]
    assert set(per_kind) == {f"{m} mixer" for m in mixers} | {f"{m} mlp" for m in mlps}
    assert all(c["equal"] == c["checked"] > 0 for c in per_kind.values())
    assert set(checks["rollback_state"]["per_layer_kind"]) == {f"{m} state" for m in mixers}
    # the full batch: a step of decodes, then one of K = MAX_K verifies for every sequence, then mixed K;
    # every layer's state compared after each sequence's step
    full = checks["full_batch_vs_alone"]
    assert full["batch_rows"][:2] == [SEQUENCES, SEQUENCES * (MAX_K + 1)]
    assert full["states_checked"] == full["states_equal"] > 0 and full["states_checked"] % n_layers == 0
    assert out.splitlines()[-1].startswith("PASS: ")


@pytest.mark.parametrize("name, first_layer", [("qwen3_5_text", "layer 1 gdn mixer"), ("kimi_linear", "layer 0 kda mixer")])
def test_check_fails_on_a_planted_row_invariance_bug(hf_checkpoint, tmp_path, capsys, monkeypatch, name, first_layer):
    """The delta rule's torch reference, made to nudge its outputs when a call carries more than
    one row: a verify row's bits then depend on how many rows share its call, while serial decode
    has one row per call. (ops.linear meets one row per call on the CPU reference, see
    ops.each_row, so the bug is planted in an op whose calls rows do share there.)"""
    honest = delta_rule.delta_rule_verify_ref

    def batch_dependent(state, query, *rest, **kwargs):
        out = honest(state, query, *rest, **kwargs)
        return out if query.shape[0] == 1 else out * (1 + 2**-20)

    monkeypatch.setattr(delta_rule, "delta_rule_verify_ref", batch_dependent)
    code, report = _check(hf_checkpoint(name), tmp_path)
    out = capsys.readouterr().out
    assert code == 1, out
    assert not report["passed"] and report["rows_equal"] < report["rows_checked"]
    first = report["first_difference"]
    # the first verify (K = 1) already differs, and the layer named is the first recurrent one
    assert first["check"] == "verify_vs_serial" and first["where"].startswith("K=1 ") and first_layer in first["where"]
    assert 0 < first["max_abs_diff"] < 1e-3
    checks = {c["name"]: c for c in report["checks"]}
    assert not checks["verify_vs_serial"]["passed"] and not checks["full_batch_vs_alone"]["passed"]
    assert out.splitlines()[-1].startswith("FAIL: ") and "first difference in verify_vs_serial" in out


def test_only_the_full_batch_sees_a_bug_of_large_batches(hf_checkpoint, tmp_path, capsys, monkeypatch):
    """The delta rule's reference, made to nudge its outputs once a call carries more rows than one
    sequence's verify can (as a GEMM whose tile followed the row count did at the published widths):
    the one-sequence checks pass, and the full batch names its first step (SEQUENCES decodes)."""
    honest = delta_rule.delta_rule_verify_ref

    def large_batch_dependent(state, query, *rest, **kwargs):
        out = honest(state, query, *rest, **kwargs)
        return out if query.shape[0] <= MAX_K + 1 else out * (1 + 2**-20)

    monkeypatch.setattr(delta_rule, "delta_rule_verify_ref", large_batch_dependent)
    first = _only_failing(hf_checkpoint("qwen3_5_text"), tmp_path, capsys, "full_batch_vs_alone")[1]
    assert first["where"].startswith(f"step 0 of {SEQUENCES} rows")


def _only_failing(model_dir, tmp_path, capsys, name: str) -> tuple[dict, dict]:
    """Run the check, which must fail in check `name` alone -> (that check's report, the first difference)."""
    code, report = _check(model_dir, tmp_path)
    assert code == 1, capsys.readouterr().out
    checks = {c["name"]: c for c in report["checks"]}
    assert [n for n, c in checks.items() if not c["passed"]] == [name]
    assert report["first_difference"]["check"] == name
    return checks[name], report["first_difference"]


def test_only_the_prompts_check_sees_a_bug_of_prompts_inside_steps(hf_checkpoint, tmp_path, capsys, monkeypatch):
    """The row-wise ops of a step that takes prompts in, made to nudge the prompt rows (as a kernel
    whose prompt rows depended on the verify rows beside them would): every other check passes,
    and prompts_in_steps names the first prompt's first row."""
    from verifier.model import hybrid, ops

    honest = ops.each_row

    def nudging(fn, *tensors, row_invariant):
        out = honest(fn, *tensors, row_invariant=row_invariant)
        if not isinstance(row_invariant, ops.MixedRows):
            return out

        def nudge(t):
            t = t.clone()
            t[row_invariant.verify :] *= 1 + 2**-10
            return t

        return tuple(nudge(t) for t in out) if isinstance(out, tuple) else nudge(out)

    monkeypatch.setattr(hybrid, "each_row", nudging)
    check, first = _only_failing(hf_checkpoint("qwen3_5_text"), tmp_path, capsys, "prompts_in_steps")
    assert "prompt 0" in first["where"] and first["where"].endswith("first row")
    # the running sequences' rows stayed equal: only the prompts' rows (and the cached chunk's start) differ
    assert 0 < check["rows_checked"] - check["rows_equal"] <= 2 * 3


def test_the_command_as_a_user_runs_it(hf_checkpoint):
    proc = subprocess.run([sys.executable, "-m", "verifier", "check", "--model", str(hf_checkpoint("qwen3_next_moe")), *SMALL],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert "qwen3_next" in lines[0] and "3 gdn + 1 attention mixers" in lines[0]
    assert "torch " in lines[1] and "triton " in lines[1] and "float32" in lines[1]
    assert lines[-1].startswith("PASS: ")
    assert "verify_vs_serial: K=3" in proc.stderr  # progress on stderr


def test_every_flag_states_its_default():
    parser = add_check_parser(argparse.ArgumentParser().add_subparsers())
    assert flags_without_stated_default(parser) == []


@pytest.mark.parametrize("args, flag", [
    (["--max-k", "0"], "--max-k"),
    (["--new-tokens", "1"], "--new-tokens"),
    (["--sequences", "1"], "--sequences"),
    (["--max-k", "1000"], "argument --max-k: must be at most 64, got 1000"),
    (["--device", "tpu"], "--device"),
    (["--dtype", "float16"], "--dtype"),
])
def test_bad_arguments_exit_2_naming_the_flag(capsys, args, flag):
    with pytest.raises(SystemExit) as exc:
        cli.main(["check", *args])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_bad_paths_exit_2_naming_the_flag(hf_checkpoint, tmp_path, capsys):
    assert cli.main(["check", "--model", str(tmp_path / "nowhere")]) == 2
    assert "--model" in capsys.readouterr().err
    assert cli.main(["check", "--model", str(hf_checkpoint("kimi_linear")), "--json", str(tmp_path / "no" / "r.json")]) == 2
    assert "--json" in capsys.readouterr().err
    assert cli.main(["check", "--model", str(hf_checkpoint("kimi_linear")), "--prompt-len", str(10**9)]) == 2
    assert "context length" in capsys.readouterr().err


def test_layer_recorder_finishes_split_sums():
    """A dense MLP's split-K down projection returns SplitSums (a NamedTuple) for the next norm to
    finish; the recorder keeps its finished rows [rows, hidden], not the tuple's first field (the
    splits' partial sums), which a mixer's (rows, record) tuple would suggest."""
    import torch

    from hybrid_kernels.linear import SplitSums
    from verifier.check.layers import LayerOutputs

    class Part:
        def forward(self, x):
            partial = torch.stack([x, 2 * x])  # [SPLIT_K = 2, rows, hidden]
            return SplitSums(partial, None, torch.float32)

    class Block:
        mixer, mlp = Part(), Part()

    class Config:
        mixers, mlps = ("gdn",), ("dense",)

    class Model:
        config, blocks = Config(), [Block()]

    # SplitSums.finish launches the reduce kernel: on the GPU where there is one, else the interpreter
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = torch.arange(15, dtype=torch.float32, device=device).view(5, 3)
    with LayerOutputs(Model()) as recorder:
        Model.blocks[0].mlp.forward(rows)
        recorded = recorder.take()
    assert torch.equal(recorded[1], 3 * rows)
