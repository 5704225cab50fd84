"""Tensor parallelism over N processes on the CPU (gloo): verifier/model/parallel/.

The contract within one parallel size N: verify rows, rolled-back state and speculative streams
equal serial decode and plain generation of the same N ranks, torch.equal (DESIGN.md sections 5
and 10). Across sizes the bits differ (a split projection adds its N partial products across
ranks, one process the whole K range in one GEMM: another summation order), so the N-rank model
is held to the one-process model within a tolerance: max |difference| <= 1e-4 of the largest
|logit| in fp32.

Starting processes is slow (each imports torch), so each multi-process test starts its ranks
once and runs every check inside; the rank functions live in this module, which the spawned
ranks import. The checkpoints: presets/tiny.py's *_tp specs, whose head counts and split sizes
divide by 2 and 3 (Qwen3-Next: interleaved GDN projections, per-expert MoE and a dense layer;
Qwen3.5-MoE: separate projections, fused experts, tied head; Kimi Linear: MLA, KDA, grouped
sigmoid router).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from bitexact.serial import serial_run, slot_state, states_equal
from verifier.engine import Engine, StepRequest
from verifier.generate import generate
from verifier.model import CheckpointError, HybridModel, load_config, load_model
from verifier.model.fp8_checkpoint import write_block_fp8_checkpoint, write_dequantized_checkpoint
from verifier.model.parallel import ParallelError, ShardedSource, TensorParallel, local_config, run_parallel
from verifier.model.parallel.sharding import VocabRows
from verifier.model.rollback import ROLLBACK_MODES
from verifier.params import SamplingParams
from verifier.proposers import OracleProposer, RandomProposer

REPO = Path(__file__).resolve().parent.parent
TP_SPECS = ("qwen3_next_tp", "qwen3_5_moe_tp", "kimi_linear_tp")
PROMPTS = ([5, 17, 33, 8, 61, 12, 40], [9, 3, 71, 22], [14, 50, 6, 88, 31, 7, 19, 2, 45])
SERIAL_TOKENS = 24
PLAN = [  # per step, per sequence: (K, how many of the K drafts are right)
    [(3, 3), (0, 0), (5, 2)],
    [(8, 1), (2, 2), (4, 4)],
    [(1, 0), (6, 0), (2, 1)],
    [(4, 4), (3, 1), (0, 0)],
]
PARITY = 1e-4  # of the largest |logit|


# ---- what every rank runs (module-level: the spawned ranks import them) ----

def _rank_checks(parallel: TensorParallel, paths: dict[str, str], fp8_pair: tuple[str, str]) -> dict:
    """Per checkpoint: the prompt's prefill logits (for the parity check in the caller), whether
    every rank holds the same logits, and the bitwise checks' failures (empty when all hold).
    fp8_pair: a block-FP8 checkpoint and its dequantized twin, whose ranks must compute the same
    bits (the CPU dequantizes at load, then cuts)."""
    fp8, dequantized = (_prefill(load_model(path, parallel=parallel)) for path in fp8_pair)
    out = {"fp8_equal": torch.equal(fp8, dequantized)}
    for name, path in paths.items():
        model = load_model(path, parallel=parallel)
        prefill = _prefill(model)
        agree = all(torch.equal(part, prefill) for part in parallel.gather(prefill))
        failures = _verify_equals_serial(model) + _speculative_equals_plain(model)
        out[name] = {"prefill": prefill, "ranks_agree": agree, "failures": failures}
    return out


def _prefill(model, prompt: list[int] = PROMPTS[0]) -> torch.Tensor:
    """The logits of every prompt row, [len(prompt), vocab] fp32, from a fresh slot."""
    pool = model.new_pool(1, 64)
    return model.prefill(pool, pool.admit(), prompt, all_logits=True)


def _drafts(serial, emitted: int, k: int, right: int, vocab: int) -> list[int]:
    truth = serial.tokens[emitted : emitted + k]
    return [t if i < right else (t + 7) % vocab for i, t in enumerate(truth)]


def _verify_equals_serial(model) -> list[str]:
    """Three sequences in one engine, each step a mix of K (0 to 8) and of right and wrong drafts:
    every verify row equals the serial decode row and every rolled-back slot state the serial
    state, torch.equal, in both rollback modes."""
    vocab, failures = model.config.vocab_size, []
    serials = [serial_run(Engine(model, 1, 64), prompt, SERIAL_TOKENS) for prompt in PROMPTS]
    for mode in ROLLBACK_MODES:
        engine = Engine(model, len(PROMPTS), 64, max_k=8, rollback_mode=mode)
        seqs = [engine.open(prompt, SamplingParams(), 40, eos_ids=()) for prompt in PROMPTS]
        rows = [[seq.first_logits[None]] for seq in seqs]
        emitted = [1] * len(seqs)
        for step, plan in enumerate(PLAN):
            requests = [StepRequest(seq, _drafts(serials[i], emitted[i], k, right, vocab))
                        for i, (seq, (k, right)) in enumerate(zip(seqs, plan))]
            for i, (result, (k, right)) in enumerate(zip(engine.step(requests), plan)):
                if result.error is not None or result.accepted != right:
                    failures.append(f"{mode} step {step} sequence {i}: accepted {result.accepted} of K={k}, expected {right} "
                                    f"({result.error})")
                emitted[i] += len(result.tokens)
                rows[i].append(result.logits)
                if not states_equal(slot_state(engine, seqs[i].slot, seqs[i].position), serials[i].states[seqs[i].position]):
                    failures.append(f"{mode} step {step} sequence {i}: the state at position {seqs[i].position} differs from serial")
        for i, serial in enumerate(serials):
            got = torch.cat(rows[i])
            if not torch.equal(got, serial.logits[: got.shape[0]]):
                failures.append(f"{mode} sequence {i}: a verify row differs from serial decode")
    return failures


def _speculative_equals_plain(model) -> list[str]:
    """Speculative generation (drafts all rejected: random; all accepted: oracle) gives plain
    generation's tokens and logits, greedy and seeded sampling."""
    failures = []
    prompt = PROMPTS[2]
    for sampling in (SamplingParams(), SamplingParams(temperature=0.8, top_k=20, seed=11)):
        plain = generate(Engine(model, 1, 64), prompt, 18, sampling, eos_ids=())
        for proposer in (RandomProposer(model.config.vocab_size, 3), OracleProposer(len(prompt), plain.tokens)):
            spec = generate(Engine(model, 1, 64, max_k=4), prompt, 18, sampling, proposer, k=4, eos_ids=())
            if spec.tokens != plain.tokens or not torch.equal(spec.logits, plain.logits):
                failures.append(f"{type(proposer).__name__} {sampling}: the speculative stream differs from the plain one")
    return failures


def _load_only(parallel: TensorParallel, path: str) -> None:
    load_model(path, parallel=parallel)


def _fail_on_rank_1(parallel: TensorParallel) -> None:
    """Rank 1 fails; the others wait for it in a collective it never joins."""
    if parallel.rank == 1:
        raise FileNotFoundError("rank 1 found no shard")
    parallel.sum(torch.ones(4))


def _exit_on_rank_1(parallel: TensorParallel) -> None:
    """Rank 1's process ends without a report (as a crash would); the others wait in a collective."""
    if parallel.rank == 1:
        os._exit(7)
    parallel.sum(torch.ones(4))


# ---- the tests ----

@pytest.fixture(scope="module")
def tp_paths(hf_checkpoint) -> dict[str, str]:
    return {name: str(hf_checkpoint(name)) for name in TP_SPECS}


@pytest.fixture(scope="module")
def fp8_pair(tp_paths, tmp_path_factory) -> tuple[str, str]:
    """qwen3_5_moe_tp in block FP8 ([16, 24] blocks: partial edge blocks, fused expert stacks) and its dequantized twin."""
    root = tmp_path_factory.mktemp("tp_fp8")
    fp8 = write_block_fp8_checkpoint(tp_paths["qwen3_5_moe_tp"], root / "fp8", (16, 24))
    return str(fp8), str(write_dequantized_checkpoint(fp8, root / "dequantized"))


@pytest.mark.parametrize("size", [2, 3])
def test_ranks_match_one_process_and_keep_the_contract(tp_paths, fp8_pair, size):
    results = run_parallel(_rank_checks, size, tp_paths, fp8_pair, timeout_s=240)
    assert results["fp8_equal"], f"{size} ranks: the FP8 checkpoint and its dequantized twin differ"
    for name, path in tp_paths.items():
        got = results[name]
        assert got["ranks_agree"], f"{name}, {size} ranks: the ranks' logits differ"
        assert not got["failures"], f"{name}, {size} ranks: " + "; ".join(got["failures"])
        alone = _prefill(load_model(path))
        worst = (got["prefill"] - alone).abs().max().item()
        assert worst <= PARITY * alone.abs().max().item(), f"{name}, {size} ranks: logits differ by {worst} from one process"


def test_one_rank_is_the_plain_model_bit_for_bit(tp_paths):
    """Size 1 (no collectives, no process) runs the sharded loading and forward: the plain bits."""
    for name, path in tp_paths.items():
        logits = []
        for parallel in (None, TensorParallel(0, 1)):
            logits.append(_prefill(load_model(path, parallel=parallel), PROMPTS[1]))
        assert torch.equal(*logits), name


@pytest.mark.parametrize("size, block_k", [(2, 3), (3, 2)])
def test_fp8_weights_kept_in_fp8_are_cut_to_the_dequantized_parts(tp_paths, tmp_path, size, block_k):
    """CUDA keeps block-FP8 weights in FP8 for its GEMMs: each rank's FP8 part (rows with their
    scale rows; inputs on a scale block boundary) dequantizes to the dequantized whole's part, bit
    for bit, for every split weight of every rank (here forced on the CPU: keep_fp8, the plumbing
    CUDA uses). Blocks [16, block_k]: partial edge row blocks, and input parts a multiple of block_k."""
    from verifier.model.fp8 import BlockFP8Weight

    fp8 = write_block_fp8_checkpoint(tp_paths["qwen3_5_moe_tp"], tmp_path / "fp8", (16, block_k))
    config = load_config(fp8)
    kept_fp8 = 0
    for rank in range(size):
        parallel = TensorParallel(rank, size)
        kept = ShardedSource(fp8, "cpu", torch.float32, config, parallel, keep_fp8=True)
        dense = ShardedSource(fp8, "cpu", torch.float32, config, parallel, keep_fp8=False)
        for name, shape in _split_weights(fp8, config, parallel):
            a, b = kept.take(name, shape), dense.take(name, shape)
            if isinstance(a, BlockFP8Weight):
                kept_fp8 += 1
                assert torch.equal(a.dequantize(), b), (rank, name)
    assert kept_fp8 > 0


def test_an_fp8_input_split_off_the_scale_blocks_is_named(fp8_pair):
    """[16, 24] blocks on 2 ranks: an expert's down projection of 6 input columns splits into 3 + 3,
    off its 24-column scale blocks: refused naming the tensor and the block."""
    config, parallel = load_config(fp8_pair[0]), TensorParallel(1, 2)
    src = ShardedSource(fp8_pair[0], "cpu", torch.float32, config, parallel, keep_fp8=True)
    with pytest.raises(CheckpointError, match="scale blocks of 24 input columns"):
        HybridModel(local_config(config, 2), src, parallel)


def _split_weights(path, config, parallel) -> list[tuple[str, tuple[int, ...]]]:
    """(name, the rank's part shape) of every tensor ShardedSource splits (scales aside), from the
    stored shapes (read through a probe source of their own)."""
    probe = ShardedSource(path, "cpu", torch.float32, config, parallel)
    out = []
    for name in sorted(probe._where):
        rule = probe.plan.rule(name)
        if rule is None or "scale_inv" in name or not hasattr(rule, "dim"):
            continue
        part = list(probe.take_raw(name).shape)
        part[rule.dim] = len(parallel.vocab_rows(rule.vocab)) if isinstance(rule, VocabRows) else part[rule.dim] // parallel.size
        out.append((name, tuple(part)))
    return out


def test_sizes_that_do_not_divide_are_named(hf_checkpoint):
    config = load_config(hf_checkpoint("qwen3_next_moe"))  # 2 KV heads, 2 key heads, shared expert 32, vocab 96
    with pytest.raises(ValueError, match=r"attention n_kv_heads .* 2 is not divisible by 3"):
        local_config(config, 3)
    local = local_config(config, 2)
    assert (local.attention.n_heads, local.attention.n_kv_heads, local.gdn.n_k_heads, local.gdn.n_v_heads) == (2, 1, 1, 2)
    assert (local.moe.expert_intermediate_size, local.moe.shared_intermediate_size, local.vocab_size) == (12, 16, 96)
    with pytest.raises(ValueError, match="rows 10 is not divisible by 4"):
        TensorParallel(1, 4).shard(10, "rows")


def test_a_vocabulary_the_ranks_do_not_divide_is_padded(tp_paths):
    """91 ids on 2 ranks: 46 rows each, the last row of rank 1 zeros; on 3 ranks 31 each, the last
    two rows of rank 2 zeros. Each rank's embedding (the tied head) holds exactly the ids of its
    range and zeros past the last id; a stored table of another vocabulary is refused, naming the
    split. (The ranks' logits, cut to the vocabulary, are held to one process's in
    test_ranks_match_one_process_and_keep_the_contract.)"""
    path = tp_paths["qwen3_5_moe_tp"]
    config = load_config(path)
    assert config.vocab_size == 91 and config.tie_word_embeddings
    whole = load_model(path).embed
    for size, part in ((2, 46), (3, 31)):
        for rank in range(size):
            parallel = TensorParallel(rank, size)
            rows = parallel.vocab_rows(91)
            assert (rows.start, len(rows)) == (rank * part, part)
            embed = ShardedSource(path, "cpu", torch.float32, config, parallel).take("model.embed_tokens.weight", (part, config.hidden_size))
            kept = max(0, min(rows.stop, 91) - rows.start)
            assert torch.equal(embed[:kept], whole[rows.start:rows.start + kept])
            assert not embed[kept:].any() and part - kept == (size * part - 91 if rank == size - 1 else 0)
    source = ShardedSource(path, "cpu", torch.float32, config, TensorParallel(0, 2))
    table = source.take_raw("model.embed_tokens.weight")
    source.take_raw = lambda name: table[:90]
    with pytest.raises(CheckpointError, match=r"expected \[91, 24\] \(tensor parallelism: vocabulary rows split into 2 parts of 46"):
        source.take("model.embed_tokens.weight", (46, 24))


def test_a_rank_that_fails_at_startup_is_an_error_in_the_caller_not_a_hang(hf_checkpoint, tmp_path):
    start = time.monotonic()
    with pytest.raises(ParallelError, match=r"rank \d of 3 failed: ValueError: .*n_kv_heads .* 2 is not divisible by 3"):
        run_parallel(_load_only, 3, str(hf_checkpoint("qwen3_next_moe")))
    empty = tmp_path / "no_weights"
    empty.mkdir()
    shutil.copy(hf_checkpoint("qwen3_next_tp") / "config.json", empty)
    with pytest.raises(ParallelError, match="neither model.safetensors nor model.safetensors.index.json") as caught:
        run_parallel(_load_only, 2, str(empty))
    assert type(caught.value.original).__name__ == "CheckpointError"
    # one rank fails while the other waits for it in a collective: that rank is named, at once
    with pytest.raises(ParallelError, match="rank 1 of 2 failed: FileNotFoundError: rank 1 found no shard"):
        run_parallel(_fail_on_rank_1, 2)
    with pytest.raises(ParallelError, match=r"rank 1 of 2 exited \(code 7\) without reporting"):
        run_parallel(_exit_on_rank_1, 2)
    elapsed = time.monotonic() - start
    assert elapsed < 60, f"four failing runs took {elapsed:.0f} s: a failure waited for a timeout"


def _cli(*args):
    argv = [sys.executable, "-m", "verifier", "generate", *map(str, args)]
    return subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=300)


def test_generate_command_on_two_ranks(tp_paths, tmp_path):
    """--tensor-parallel 2: the speculative run prints the plain run's tokens and logits; a size
    that does not divide the heads exits 2 naming the field."""
    runs = []
    for i, extra in enumerate(((), ("--draft", "random", "--k", 3))):
        out = tmp_path / f"logits{i}.npy"
        proc = _cli("--model", tp_paths["qwen3_5_moe_tp"], "--prompt-ids", "5,6,7,8", "--max-new-tokens", 10,
                    "--tensor-parallel", 2, "--json", "--logits-out", out, *extra)
        assert proc.returncode == 0, proc.stderr
        runs.append((json.loads(proc.stdout), np.load(out)))
    (plain, plain_logits), (spec, spec_logits) = runs
    assert spec["tokens"] == plain["tokens"] and len(plain["tokens"]) == 10 and spec["steps"] < 10 + 1
    assert np.array_equal(spec_logits, plain_logits) and plain_logits.shape == (10, 91)  # the vocabulary, no padding column
    proc = _cli("--model", tp_paths["qwen3_next_tp"], "--prompt-ids", "5", "--max-new-tokens", 2, "--tensor-parallel", 4)
    assert proc.returncode == 2 and "n_kv_heads" in proc.stderr and "6 is not divisible by 4" in proc.stderr
