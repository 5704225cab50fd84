"""The serving bench (bench/serve.py) in CI size, on the CPU: the tiny checkpoint of bench/load, 4
sessions from 2 drafter processes (then 4), a few steps, and the remote drafter part with the tiny
checkpoint as its own draft model; through the same code as the H200 run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from decimal import Decimal

from bench import serve_breakdown
from bench.load.remote_pair import remote_drafter
from bench.serve import ServeConfig, _expected, main, mtp_line, run_serve, server_has_flag, table
from verifier.server.timings import request_key
from presets.bench_models import TINY_CONFIG, TINY_EMBED_STD

SESSIONS, PROCESSES, WARMUP, STEPS, K = 4, 2, 2, 4, 2
MODEL_FIELDS = ("sessions", "engine_tokens_per_s", "service_tokens_per_s", "service_over_engine", "p50_ms", "p99_ms",
                "graph_captures_during_load", "rss_before_mib", "rss_after_mib", "random_drafts_vs_plain_b64",
                "oracle_trimmed_vs_untrimmed", "mismatches")
REMOTE_FIELDS = ("k", "plain_tokens_per_s", "remote_model_tokens_per_s", "remote_model_speedup", "inprocess_model_speedup")
MTP_FIELDS = ("remote_mtp_tokens_per_s", "remote_mtp_speedup", "remote_mtp_mean_acceptance_length", "inprocess_mtp_tokens_per_s",
              "inprocess_mtp_speedup", "inprocess_mtp_mean_acceptance_length")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from verifier.model.random_checkpoint import write_random_checkpoint

    return write_random_checkpoint(TINY_CONFIG, tmp_path_factory.mktemp("serve") / "tiny", seed=0, std=TINY_EMBED_STD)


def test_a_short_run_writes_every_field_and_every_stream_equals_plain_decoding(tmp_path, tiny):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt_ids": [5 + i, 6, 7, 8, 5 + i, 6, 7]}) for i in range(3)))
    config = ServeConfig(out=tmp_path, models=(str(tiny),), device="cpu", sessions=SESSIONS, processes=PROCESSES,
                         warmup_steps=WARMUP, steps=STEPS, k=K, remote_target=tiny, remote_draft=tiny,
                         remote_prompts=prompts, remote_prompt_count=2, remote_new_tokens=8, time_limit_s=120, pairs=2,
                         cohorts=(1, 2))
    result = run_serve(config)
    written = json.loads(Path(result["path"]).read_text())
    assert Path(result["path"]).name == f"serve_{written['date']}.json"
    for field in ("device", "date", "torch", "triton", "models", "remote_drafter"):
        assert field in written, field
    model = written["models"]["tiny"]
    for field in MODEL_FIELDS:
        assert field in model, field
    assert model["mismatches"] == 0 and model["errors"] == 0 and written["ok"]
    assert model["sessions"] == SESSIONS and model["engine"]["sequences"] == SESSIONS
    assert model["engine"]["timed_steps"] == STEPS and model["engine"]["tokens"] == SESSIONS * STEPS
    assert model["graph_captures_during_load"] in (0, None)  # no graphs on the CPU
    assert model["rss_before_mib"] > 0 and model["rss_after_mib"] > 0
    runs = model["runs"]
    assert runs["plain"]["transport"] == "fleet" and runs["plain_verify_calls"]["transport"] == "fleet-verify"
    assert model["service_tokens_per_s_verify_calls"] > 0
    for name, processes in (("plain", PROCESSES), ("plain_more_processes", 2 * PROCESSES), ("plain_verify_calls", PROCESSES),
                            ("random", PROCESSES)):
        run = runs[name]
        # every session took its timed steps, one request per round per process
        assert run["steps"] == SESSIONS * STEPS and run["rounds"] == processes * STEPS, name
        assert run["processes"] == processes and run["compared_generations"] == SESSIONS and run["mismatches"] == 0
        assert 0 < run["p50_ms"] <= run["p99_ms"]
        # a step's time on the server holds the whole engine step it ran in, and every batch ran a
        # step: the engine's total is at most the steps' total (not so the means: a slow batch of
        # one step weighs more among the batches than among the steps)
        assert 0 < run["engine_ms_per_batch"] and 0 < run["server_latency_mean_ms"] and run["ms_per_batch"] > 0, name
        assert 0 < run["engine_ms_total"] <= run["server_latency_ms_total"], name
    assert runs["plain"]["tokens"] == SESSIONS * STEPS  # plain decoding: one token per step
    # --cohorts 1,2: a second server with the sessions in two cohorts, its plain and random runs the same streams
    assert model["cohorts"] == 1 and list(model["other_cohorts"]) == ["2"]
    for name in ("plain_cohorts_2", "random_cohorts_2"):
        run = runs[name]
        assert run["steps"] == SESSIONS * STEPS and run["compared_generations"] == SESSIONS and run["mismatches"] == 0, name
    assert model["other_cohorts"]["2"]["service_over_engine"] > 0 and model["other_cohorts"]["2"]["random_over_engine"] > 0
    assert "with --cohorts 2" in table(written)
    for name in ("plain", "plain_more_processes", "plain_verify_calls", "random", "oracle"):
        _assert_breakdown_adds_up(runs[name], name)
    assert model["round_breakdown_ms"] == runs["plain"]["round_breakdown_ms"]
    assert model["added_ms_per_round"] == runs["plain"]["added_ms_per_round"]
    assert model["service_over_engine"] > 0 and model["random_drafts_vs_plain_b64"] > 0
    # --pairs 2: each ratio measured twice, the second pair in the other order; the median reported
    ratios = model["pair_ratios"]
    assert len(ratios["random_vs_plain"]) == 2 and model["random_drafts_vs_plain_b64"] == round(sum(ratios["random_vs_plain"]) / 2, 3)
    second = runs["random_vs_plain_pair_2"]
    assert list(second) == ["drafts", "baseline"]  # pair 1 ran plain first
    assert second["drafts"]["drafter"] == "random" and second["baseline"]["drafter"] == "none"
    assert second["drafts"]["mismatches"] == 0 and second["baseline"]["mismatches"] == 0
    if server_has_flag("--no-goodput"):
        assert len(ratios["oracle_trimmed_vs_untrimmed"]) == 2
        # one server at a time: the trimmed runs on the first, the untrimmed ones on the second
        pair = runs["oracle_trimmed_vs_untrimmed_pair_2"]
        assert list(pair) == ["drafts", "baseline"] and pair["baseline"]["mean_acceptance_length"] == K + 1
        # untrimmed, the oracle's every draft is accepted: K + 1 tokens per step
        assert runs["oracle_untrimmed"]["mean_acceptance_length"] == K + 1
        assert runs["oracle_untrimmed"]["mismatches"] == 0 and model["oracle_trimmed_vs_untrimmed"] > 0
    else:
        assert model["oracle_trimmed_vs_untrimmed"] is None
    remote = written["remote_drafter"]
    for field in REMOTE_FIELDS:
        assert field in remote, field
    assert remote["k"] == K and remote["streams_equal"]
    assert set(remote["ms_per_round"]) == {"remote_plain", "remote_model", "inprocess_plain", "inprocess_model"}
    for mode in ("remote_model", "inprocess_model"):  # drafting is a part of a round, never more
        assert 0 < remote["drafting_ms_per_round"][mode] < remote["ms_per_round"][mode], (mode, remote)
    for mode in ("remote_plain", "remote_model"):  # the server's engine step is within its step's latency, within the round
        engine, latency = remote["server_engine_ms_per_round"][mode], remote["server_latency_ms_per_round"][mode]
        assert 0 < engine <= latency < remote["ms_per_round"][mode], (mode, remote)
    # the draft model is the target itself: in process every draft is accepted; the server (goodput on,
    # as a user starts it) may verify fewer drafts than were sent, never more
    assert remote["inprocess_mean_acceptance_length"] == K + 1
    assert 1.0 <= remote["remote_mean_acceptance_length"] <= K + 1
    # the tiny checkpoint has no MTP head: the MTP modes are skipped, and the file says why
    assert "no MTP head" in remote["mtp_skipped"] and "['ngram']" in remote["mtp_skipped"]
    assert all(remote[field] is None for field in MTP_FIELDS)
    assert f"MTP self-drafting skipped: {remote['mtp_skipped']}" in table(written)


def test_the_remote_part_runs_mtp_through_the_service_and_in_process_when_the_target_has_a_head(tmp_path, mtp_checkpoint):
    """A target with an MTP head: MTP self-drafting through the service and MTP in process run beside
    plain and the model drafter (the target drafting for itself), every stream the plain one."""
    target = mtp_checkpoint("qwen3_5_text")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt_ids": [21 + i, 4, 58, 9, 21 + i, 4, 58]}) for i in range(2)))
    remote = remote_drafter(target, target, prompts, 2, 12, K, "cpu", "float32", "cpu")
    assert remote["mtp_skipped"] is None
    assert set(remote["ms_per_round"]) == {"remote_plain", "remote_model", "inprocess_plain", "inprocess_model",
                                           "remote_mtp", "inprocess_mtp"}
    assert remote["streams_equal"] and all(remote["streams_equal_by_mode"].values())
    assert set(remote["streams_equal_by_mode"]) == set(remote["ms_per_round"])
    for field in MTP_FIELDS:
        assert remote[field] > 0, field
    # in process every draft is verified; through the service (goodput on, as a user starts it) at most K
    assert 1.0 <= remote["inprocess_mtp_mean_acceptance_length"] <= K + 1
    assert 1.0 <= remote["remote_mtp_mean_acceptance_length"] <= K + 1
    # MTP drafts in this process only in process; through the service the server drafts, inside its step
    assert 0 < remote["drafting_ms_per_round"]["inprocess_mtp"] < remote["ms_per_round"]["inprocess_mtp"]
    assert "remote_mtp" not in remote["drafting_ms_per_round"]
    engine, latency = remote["server_engine_ms_per_round"]["remote_mtp"], remote["server_latency_ms_per_round"]["remote_mtp"]
    assert 0 < engine <= latency < remote["ms_per_round"]["remote_mtp"]
    line = mtp_line(remote)
    assert line.startswith(f"MTP K={K}: through the service") and "streams equal to plain: True / True" in line


def _assert_breakdown_adds_up(run: dict, name: str) -> None:
    """Every part is there and non-negative (the remainder may take either sign), and the reported
    parts add up to the reported round exactly."""
    parts = run["round_breakdown_ms"]
    assert parts is not None, name
    assert set(parts) == {"round", *serve_breakdown.PARTS}, name
    assert parts["round"] == run["ms_per_batch"], name
    for key in ("engine", "server_in", "server_out", "wire", "drafter"):
        assert parts[key] >= 0, (name, key, parts)
    assert sum(Decimal(str(parts[key])) for key in serve_breakdown.PARTS) == Decimal(str(parts["round"])), (name, parts)
    assert run["added_ms_per_round"] == float(Decimal(str(parts["round"])) - Decimal(str(parts["engine"]))) >= 0, name
    assert run["added_ms_per_round_p50"] >= 0, name
    detail = run["round_detail_ms"]
    assert detail["batches"] == run["engine_batches"] and detail["drafter_rounds"] == run["rounds"], (name, detail)
    assert 0 <= detail["proposing"] <= parts["drafter"] and detail["server_residence"] <= detail["drafter_request"], name
    assert detail["drafter_cpu"] > 0 and 0 <= detail["drafter_gc"] <= detail["drafter_round"], (name, detail)
    # every timed round's request ran in the run's batches: each is paired with the server's record of it
    assert detail["paired_requests"] == run["rounds"] == detail["requests"], (name, detail)


def _synthetic_run():
    """Two processes, two rounds, each round one batch; times in seconds on each process's own clock
    (the drafters' clock differs from the server's: only intervals are used). Each request is named
    on both sides by its first step's request id: the server writes its key, the drafter the id."""
    key = request_key
    server = {"batch_fields": ["first_arrival", "last_arrival", "engine_start", "engine_end", "last_written"],
              "request_fields": ["batch", "arrival", "written", "key"],
              # batch 1: arrivals at 10.000 and 10.001, engine 10.002-10.005, answers 10.0055 and 10.006
              "batches": [[10.000, 10.001, 10.002, 10.005, 10.006], [10.010, 10.010, 10.011, 10.014, 10.015],
                          [20.0, 20.0, 20.0, 20.1, 20.1]],  # batch 3: another run's
              "requests": [[1, 10.000, 10.0055, key("a-0")], [1, 10.001, 10.006, key("b-0")],
                           [2, 10.010, 10.015, key("a-1")], [2, 10.010, 10.015, key("b-1")], [3, 20.0, 20.1, key("c-0")]]}
    # each process: 2 rounds, requests of 7 + 6 ms, proposing 0.5 ms a round, 20 ms in all
    workers = [{"rounds": 2, "round_seconds": {"request": 0.013, "proposing": 0.001, "timed": 0.020, "cpu": 0.004, "gc": 0.0005},
                "round_requests": [[f"{p}-0", 0.007], [f"{p}-1", 0.006]]} for p in ("a", "b")]
    return server, workers


def test_the_breakdown_arithmetic_on_synthetic_timestamps():
    server, workers = _synthetic_run()
    batches, requests = serve_breakdown.window(server, 1, 2)
    assert sorted(batches) == [1, 2] and len(requests) == 4
    drafters = serve_breakdown.drafter_sums(workers + [{"rounds": 0}])  # a process without fleet rounds adds nothing
    assert drafters == {"rounds": 4, "request": 0.026, "proposing": 0.002, "timed": 0.040, "cpu": 0.008, "gc": 0.001}
    drafted = serve_breakdown.drafter_requests(workers + [{"rounds": 0}])
    assert drafted == {request_key("a-0"): 0.007, request_key("a-1"): 0.006, request_key("b-0"): 0.007, request_key("b-1"): 0.006}
    got = serve_breakdown.breakdown(10.5, batches, requests, drafters, drafted)
    parts, detail = got["round_breakdown_ms"], got["round_detail_ms"]
    # engine: 3 ms a batch; in: requests waited 2, 1, 1, 1 ms; out: 0.5, 1, 1, 1 ms; wire, per request:
    # 7 - 5.5, 7 - 5, 6 - 5, 6 - 5 ms, mean 1.375; drafter (20 - 13) / 2 = 3.5 ms;
    # they add up to the drafters' 10 ms round, the round of 10.5 ms leaves 0.5 unexplained
    assert parts == {"round": 10.5, "engine": 3.0, "server_in": 1.25, "server_out": 0.875, "wire": 1.375,
                     "drafter": 3.5, "unexplained": 0.5}
    assert detail["drafter_request"] == 6.5 and detail["server_residence"] == 5.125 and detail["paired_requests"] == 4
    assert detail["drafter_round"] == 10.0 and detail["proposing"] == 0.5 and detail["fleet_python"] == 3.0
    assert detail["drafter_cpu"] == 2.0 and detail["drafter_gc"] == 0.25  # per drafter round
    # a process from before the CPU and collector records: the sums say nothing of them
    older = [{**w, "round_seconds": {k: v for k, v in w["round_seconds"].items() if k not in ("cpu", "gc")}} for w in workers]
    assert serve_breakdown.drafter_sums(workers[:1] + older[1:])["cpu"] is None
    assert detail["batch_first_arrival_to_engine"] == 1.5 and detail["batch_arrival_spread"] == 0.5
    assert detail["batch_engine_end_to_last_written"] == 1.0
    # the parts before the remainder add up to the drafters' round: in + engine + out is the residence
    assert parts["engine"] + parts["server_in"] + parts["server_out"] + parts["wire"] + parts["drafter"] == detail["drafter_round"]
    assert got["added_ms_per_round"] == 7.5
    assert got["added_ms_per_round_p50"] == 6.0  # batch 1: next start 10.011 - 10.002 - its 3 ms step; batch 2 has no next
    assert serve_breakdown.breakdown(10.5, {}, [], drafters, drafted)["round_breakdown_ms"] is None  # no server timings
    assert serve_breakdown.breakdown(10.5, batches, requests, serve_breakdown.drafter_sums([]), {})["added_ms_per_round"] is None
    # no request found on both sides (a timings file from before the keys: no "key" field): no breakdown
    old_file = {**server, "request_fields": ["batch", "arrival", "written"], "requests": [r[:3] for r in server["requests"]]}
    assert serve_breakdown.breakdown(10.5, *serve_breakdown.window(old_file, 1, 2), drafters, drafted)["round_breakdown_ms"] is None
    assert "unexpl." in serve_breakdown.table({"plain": got}) and serve_breakdown.table({"plain": {}}) == ""


def test_the_wire_is_each_drafter_request_minus_the_servers_residence_of_that_request():
    """The wire pairs each drafter request with the server's record of it (by key): requests on one
    side only count in neither mean. Here the server's window holds batch 3 (another run's request,
    100 ms on the server) and the drafters timed a round the window lacks (b-2, 1 ms): the means over
    each side's own requests would put the drafter's request below the server's residence (a negative
    wire); paired, the wire is the 1.375 ms each request actually spent outside the server."""
    server, workers = _synthetic_run()
    workers[1]["round_requests"].append(["b-2", 0.001])
    workers[1]["rounds"] += 1
    workers[1]["round_seconds"] = {"request": 0.014, "proposing": 0.0015, "timed": 0.027, "cpu": 0.005, "gc": 0.0}
    batches, requests = serve_breakdown.window(server, 1, 3)
    drafters, drafted = serve_breakdown.drafter_sums(workers), serve_breakdown.drafter_requests(workers)
    unpaired = (drafters["request"] / drafters["rounds"] - sum(r["written"] - r["arrival"] for r in requests) / len(requests))
    assert unpaired * 1000 < -15  # 5.4 ms over the drafters' rounds, 24.1 ms over the window's requests
    got = serve_breakdown.breakdown(30.0, batches, requests, drafters, drafted)
    parts, detail = got["round_breakdown_ms"], got["round_detail_ms"]
    assert parts["wire"] == 1.375 and detail["paired_requests"] == 4 and detail["requests"] == 5
    assert detail["drafter_request"] == 6.5 and detail["server_residence"] == 5.125
    # a key the server wrote twice (a request resent under its ids) pairs with neither record
    resent = requests + [{**requests[0], "arrival": requests[0]["arrival"] + 0.001}]
    again = serve_breakdown.breakdown(30.0, batches, resent, drafters, drafted)["round_detail_ms"]
    assert again["paired_requests"] == 3 and again["drafter_request"] == round((7 + 6 + 6) / 3, 3)
    assert again["server_residence"] == round((5 + 5 + 5) / 3, 3)


def test_the_reference_is_cut_where_a_generation_stopped():
    plain = ([1, 2, 3, 4], "eos")
    assert _expected({"tokens": [1, 2, 3, 4]}, plain) == ([1, 2, 3, 4], "eos")
    assert _expected({"tokens": [1, 2]}, plain) == ([1, 2], "length")  # cut by its steps: compared on what it emitted


def test_bad_options_exit_2(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--model", "tiny", "--device", "cpu", "--sessions", "2", "--processes", "3"]) == 2
    assert "processes" in capsys.readouterr().err
    assert main(["--out", str(tmp_path), "--model", "2b", "--device", "cpu"]) == 2
    assert "2b needs --device cuda" in capsys.readouterr().err
    assert main(["--out", str(tmp_path), "--model", "fp8-real-size", "--device", "cpu"]) == 2  # full size: the GPU only
    assert "--fp8-scale tiny runs on the CPU" in capsys.readouterr().err


def test_a_failing_model_keeps_the_models_before_it(tmp_path, monkeypatch):
    """The results file is written after every model: a model that fails holds its error, the one
    before keeps its figures, the run goes on, and the exit status says it failed."""
    from bench import serve

    def bench_model(config, name, model_dir, scratch):
        if name == "second":
            raise RuntimeError("CUDA out of memory")
        return {"mismatches": 0, "errors": 0, "figures": name}

    monkeypatch.setattr(serve, "checkpoint", lambda name, scratch, config: Path(scratch) / name)
    monkeypatch.setattr(serve, "bench_model", bench_model)
    config = serve.ServeConfig(out=tmp_path, models=("first", "second", "third"), remote=False)
    result = serve.run_serve(config)
    written = json.loads(Path(result["path"]).read_text())
    assert written["models"]["first"] == {"mismatches": 0, "errors": 0, "figures": "first"}
    assert written["models"]["second"] == {"error": "RuntimeError: CUDA out of memory"}
    assert written["models"]["third"]["figures"] == "third"
    assert written["ok"] is False
    failed_only = {"models": {"second": written["models"]["second"]}, "remote_drafter": None}
    assert "second FAILED: RuntimeError: CUDA out of memory" in serve.table(failed_only)
