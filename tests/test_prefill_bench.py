"""bench.prefill at tiny scale on the CPU: it runs end to end, the cached start equals the cold
one, and the results file holds the figures the report reads."""

import json

import pytest

from bench import prefill
from hybrid_kernels import delta_rule_chunked, gdn_heads, moe_grouped
from verifier.model.layers import attend, linear_attention, mlp


@pytest.mark.parametrize("optional_forms", [False, True])
def test_the_prefill_bench_runs_and_its_cached_start_is_cold(tmp_path, monkeypatch, optional_forms):
    monkeypatch.setattr(linear_attention, "CHUNKED_PREFILL", False)  # what --chunked-delta-rule sets, restored after
    monkeypatch.setattr(linear_attention, "PREFILL_CONV_RUN_ROWS", 0)  # what --conv-run-rows sets
    monkeypatch.setattr(gdn_heads, "HEADS_ROWS_PER_PROGRAM", 1)  # what --heads-rows sets
    monkeypatch.setattr(attend, "TILED_PREFILL", False)  # what --[no-]tiled-attention sets
    monkeypatch.setattr(mlp, "PREFILL_EXPERT_TILES", False)  # what --[no-]expert-tiles sets
    monkeypatch.setattr(moe_grouped, "SCALE_AFTER_ON", True)  # what --expert-walk sets
    monkeypatch.setattr(delta_rule_chunked, "DOT_PRECISION", "ieee")  # what --chunked-precision sets
    code = prefill.main(["--out", str(tmp_path), "--scale", "tiny", "--device", "cpu", "--prompt-tokens", "96", "--chunk", "16",
                         "--running", "3", "--arriving", "2", "--steps", "4", "--repeats", "2", "--cache-gb", "0.1"]
                        + (["--chunked-delta-rule", "--chunked-precision", "tf32x3", "--tiled-attention", "--expert-tiles",
                            "--expert-walk", "dequantize", "--conv-run-rows", "16", "--heads-rows", "4"] if optional_forms else []))
    (path,) = tmp_path.glob("prefill_*.json")
    result = json.loads(path.read_text())
    assert result["chunked_delta_rule"] == optional_forms and result["tiled_attention"] == optional_forms
    assert result["expert_tiles"] == optional_forms and result["conv_run_rows"] == (16 if optional_forms else 0)
    assert result["heads_rows"] == (4 if optional_forms else 1)
    assert result["chunked_precision"] == ("tf32x3" if optional_forms else "ieee")
    assert result["expert_walk"] == ("dequantize" if optional_forms else "scale-after")
    assert code == 0 and result["cached_equals_cold"] and result["cached_tokens"] == 64  # 4 of the 16-token chunks
    # the default turn (2048 rows) holds a chunk of both arriving prompts: a step before each pair of chunks
    assert result["ttft_cold_ms"] > 0 and result["ttft_floor_ms"] > 0 and result["steps_arriving"] == 96 // 16
    assert result["cache"]["hits"] == 1 and result["step_p99_ratio"] > 0 and result["together_ms"] > 0
    assert result["together_equals_alone"] and result["arriving_equal_alone"] and result["step_prompt_rows"] == 0


def test_a_turn_of_one_chunk_steps_before_every_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(attend, "TILED_PREFILL", True)  # the default, which --no-tiled-attention turns off
    code = prefill.main(["--out", str(tmp_path), "--scale", "tiny", "--device", "cpu", "--prompt-tokens", "64", "--chunk", "16",
                         "--prefill-rows", "16", "--running", "2", "--arriving", "2", "--steps", "3", "--repeats", "1",
                         "--cache-gb", "0.1", "--no-tiled-attention"])
    (path,) = tmp_path.glob("prefill_*.json")
    result = json.loads(path.read_text())
    assert code == 0 and result["prefill_rows"] == 16 and result["steps_arriving"] == 2 * 64 // 16
    assert result["tiled_attention"] is False


def test_steps_that_take_the_prompts_in_step_before_every_chunk(tmp_path):
    """--step-prompt-rows: each running step takes the arriving prompts' next chunks in (whole
    chunks on the CPU reference: Engine.piece_limit), as many as fit its rows, and the prompts
    still start with the bits of their opens alone."""
    code = prefill.main(["--out", str(tmp_path), "--scale", "tiny", "--device", "cpu", "--prompt-tokens", "64", "--chunk", "16",
                         "--step-prompt-rows", "16", "--running", "2", "--arriving", "2", "--steps", "3", "--repeats", "1",
                         "--cache-gb", "0.1"])
    (path,) = tmp_path.glob("prefill_*.json")
    result = json.loads(path.read_text())
    assert code == 0 and result["step_prompt_rows"] == 16 and result["arriving_equal_alone"]
    assert result["steps_arriving"] == 2 * 64 // 16  # a chunk a step, the two prompts in turn
