"""The serving bench: the engine alone and the same engine through the service, side by
side in one run, and a remote drafter against the in-process pair.
How it measures, what it checks and writes: bench/README.md, Methods, `bench.serve`.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager, redirect_stderr
from io import StringIO
from pathlib import Path

import torch

from bench import serve_breakdown
from bench.load import processes, reference, report, workload
from bench.load.drafters import FLEET, FLEET_VERIFY
from bench.load.progress import StepProgress, say
from bench.load.server import REPO, ServerProcess
from bench.machine import NAME_HELP, check_name, device_name, results_path
from drafter.client import VerifierClient
from verifier.defaults import SHIPPED_DRAFT, SHIPPED_TARGET
from verifier.engine import LENGTH
from verifier.server.app import build_engine
from verifier.server.config import ServerConfig
from verifier.model.hf_config import load_config

TAG = "serve"
FP8 = "fp8-real-size"  # bench.fp8_real_size's checkpoint (--fp8-config, --fp8-scale), written by its writer
MODEL_NAMES = ("shipped", "2b", "tiny", FP8)
REMOTE_PROMPTS = REPO / "bench" / "prompts" / "stdlib_validation.jsonl"
NO_GOODPUT = "--no-goodput"
ROUND_TIMINGS = "--round-timings"
QUICK = {"steps": 60, "remote_prompt_count": 4, "remote_new_tokens": 64}


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    out: Path
    models: tuple[str, ...] = ("shipped", "2b")
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    dtype: str | None = None  # None: bfloat16 on a GPU, float32 on the CPU
    sessions: int = 64
    processes: int = 4
    warmup_steps: int = 5
    steps: int = 200
    k: int = 4
    remote: bool = True
    remote_target: Path = SHIPPED_TARGET
    remote_draft: Path = SHIPPED_DRAFT
    remote_prompts: Path = REMOTE_PROMPTS
    remote_prompt_count: int = 12
    remote_new_tokens: int = 128
    draft_device: str | None = None  # None: --device
    time_limit_s: float = 300.0
    seed: int = 0
    pairs: int = 1  # pairs per ratio (random vs plain, oracle trimmed vs untrimmed); the median is reported
    name: str = ""  # what differs from the default run (a model, a host), appended to the results file's name
    fp8_config: str = "qwen3.6-35b-a3b"  # --model fp8-real-size: the published config it writes
    fp8_scale: str = "full"  # or "tiny": the same layers shrunk, for the CPU
    workdir: Path | None = None  # where the temporary checkpoints go (None: the system's temporary folder)
    # the servers' --cohorts (groups of sessions whose batches take turns on the engine): every run
    # above with the first; each further value, a server of its own for a plain and a random-drafts run
    cohorts: tuple[int, ...] = (1,)

    def __post_init__(self):
        check_name(self.name)
        if not 1 <= self.processes <= self.sessions:
            raise ValueError(f"need 1 <= processes <= sessions, got processes {self.processes}, sessions {self.sessions}")
        if self.warmup_steps < 1 or self.steps < 1 or self.k < 1:
            raise ValueError(f"--warmup-steps, --steps and --k must be >= 1, got {self.warmup_steps}, {self.steps}, {self.k}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda, but torch sees no CUDA device")
        if "2b" in self.models and self.device != "cuda":
            raise ValueError("--model 2b needs --device cuda (a 2B checkpoint on this CPU would take hours)")
        if FP8 in self.models and self.fp8_scale == "full" and self.device != "cuda":
            raise ValueError(f"--model {FP8} at --fp8-scale full needs --device cuda (--fp8-scale tiny runs on the CPU)")
        if self.fp8_scale not in ("full", "tiny"):
            raise ValueError(f"--fp8-scale must be full or tiny, got {self.fp8_scale!r}")
        if not self.cohorts or min(self.cohorts) < 1:
            raise ValueError(f"--cohorts must list values >= 1, got {self.cohorts}")
        if self.pairs < 1:
            raise ValueError(f"--pairs must be >= 1, got {self.pairs}")
        if self.remote_prompt_count < 1 or self.remote_new_tokens < 2 or self.time_limit_s <= 0:
            raise ValueError("--remote-prompt-count >= 1, --remote-new-tokens >= 2 and --time-limit-s > 0 are needed")

    @property
    def served_dtype(self) -> str:
        return self.dtype or ("bfloat16" if self.device == "cuda" else "float32")

    @property
    def reference_tokens(self) -> int:
        """Plain tokens per prompt: enough for every service run's rounds even when each accepts all K."""
        return 1 + (self.warmup_steps + self.steps) * (self.k + 1)

    def server_config(self, model_dir: Path) -> ServerConfig:
        """The load runs' server, in this process (the engine alone) and as its flags (the service)."""
        round_rows = self.sessions * (self.k + 1)  # a round of every session is one batch
        # at least a round's rows: a graph bucket's padding rows live in the scratch slot, so the
        # bucket that holds a whole round exists only where a slot holds that many rows
        max_seq_len = max(workload.PROMPT_MAX + self.reference_tokens + self.k + 1, round_rows)
        return ServerConfig(model_dir, port=0, device=self.device, dtype=self.served_dtype, n_slots=self.sessions,
                            max_seq_len=max_seq_len, max_k=self.k, max_batch_rows=round_rows)


def checkpoint(name: str, scratch: Path, config: ServeConfig) -> Path:
    if name == "shipped":
        return SHIPPED_TARGET
    if name == "2b":
        from bench.gpu import build_checkpoint
        from presets.bench_models import DENSE_2B

        say("writing the random 2B checkpoint (bench/gpu.py's writer)", TAG)
        build_checkpoint("qwen3_5_text", DENSE_2B, scratch / "qwen35_2b")
        return scratch / "qwen35_2b"
    if name == "tiny":
        from presets.bench_models import TINY_CONFIG, TINY_EMBED_STD, TINY_NAME
        from verifier.model.random_checkpoint import write_random_checkpoint

        return write_random_checkpoint(TINY_CONFIG, scratch / TINY_NAME, seed=0, std=TINY_EMBED_STD)
    if name == FP8:
        from bench.fp8_real_size import checkpoint_config, write_checkpoint

        path = scratch / f"{config.fp8_config}-fp8"  # the results' model key: as bench.fp8_real_size names it
        say(f"writing the random block-FP8 {config.fp8_config} checkpoint at {config.fp8_scale} scale "
            "(bench/fp8_real_size.py's writer)", TAG)
        write_checkpoint(path, checkpoint_config(config.fp8_config, config.fp8_scale), "per-expert", seed=0,
                         device=torch.device(config.device), shard_bytes=4 * 10**9)
        return path
    return Path(name)


def server_has_flag(flag: str, *values: str) -> bool:
    """Whether `python -m verifier serve` takes `flag` (with `values`, when it takes some)."""
    from verifier.cli import build_parser

    with redirect_stderr(StringIO()):
        _, unknown = build_parser().parse_known_args(["serve", "--port", "0", flag, *values])
    return not unknown


# -- one model ---------------------------------------------------------------------------------


def engine_alone(config: ServeConfig, model_dir: Path, plan: workload.Plan) -> tuple[dict, dict[int, tuple[list[int], str]]]:
    engine = build_engine(config.server_config(model_dir))
    prompts = [workload.prompt(plan, i, 0) for i in range(config.sessions)]
    say(f"engine alone: {config.sessions} sequences, {config.warmup_steps} + {config.steps} timed steps, then on to "
        f"{config.reference_tokens} tokens each for the reference", TAG)
    figures, streams = reference.timed_plain_decoding(engine, prompts, config.reference_tokens, config.warmup_steps,
                                                      config.steps)
    figures["graph_captures"] = getattr(engine, "graph_captures", None)
    del engine
    _free_device_memory()
    return figures, dict(enumerate(streams))


def service_run(config: ServeConfig, address: str, client: VerifierClient, plan: workload.Plan, n_processes: int,
                streams: dict[int, tuple[list[int], str]], scratch: Path, label: str, at_start=None,
                transport: str = FLEET) -> dict:
    """One fleet run of every session; figures of its timed rounds and its comparison with `streams`."""
    snapshots = {}

    def start() -> None:  # every process has warmed up and waits for the go
        snapshots["before"] = client.stats()
        if at_start is not None:
            at_start()

    references = {i: tokens for i, (tokens, _) in streams.items()} if plan.drafter == "oracle" else None
    say(f"{label}: {config.sessions} sessions from {n_processes} processes", TAG)
    with StepProgress(address, config.sessions * plan.steps, label, tag=TAG):
        workers = processes.run_drafters(address, plan, processes.shares(config.sessions, n_processes), transport,
                                         time.time() + config.time_limit_s, scratch, references=references,
                                         warmup_rounds=config.warmup_steps, at_start=start)
    after = client.stats()
    before = snapshots.get("before", after)
    figures, served = report.step_figures(workers), report.server_figures(before, after)
    generations = [g for w in workers for g in w["generations"]]
    wrong = reference.mismatches(generations, [_expected(g, streams[g["session"]]) for g in generations])
    captures = [getattr(s, "graph_captures", None) for s in (before, after)]
    trimmed = [getattr(s, "trimmed_drafts", None) for s in (before, after)]
    return {
        "processes": n_processes, "transport": transport, "drafter": plan.drafter, "k": 0 if plan.drafter == "none" else plan.k,
        **{key: figures[key] for key in ("steps", "rounds", "tokens", "wall_s", "tokens_per_s", "tokens_per_step",
                                         "p50_ms", "p99_ms", "max_ms", "errors", "errors_by_code", "partial")},
        "engine_batches": served["engine_batches"], "rows_per_batch_mean": served["rows_per_batch_mean"],
        "batches_per_s": round(served["engine_batches"] / figures["wall_s"], 2) if figures["wall_s"] else None,
        # a round's time: wall over batches; of it, the engine step and a step's time on the server
        # (arrival to result); the rest is gRPC, the network and the drafter processes
        "ms_per_batch": round(figures["wall_s"] * 1000 / served["engine_batches"], 3) if served["engine_batches"] else None,
        "engine_ms_per_batch": served["engine_ms_per_batch"], "server_latency_mean_ms": served["server_latency_mean_ms"],
        "engine_ms_total": served["engine_ms_total"], "server_latency_ms_total": served["server_latency_ms_total"],
        "mean_acceptance_length": served["mean_acceptance_length"],
        "graph_captures": None if None in captures else captures[1] - captures[0],
        "trimmed_drafts": None if None in trimmed else trimmed[1] - trimmed[0],
        "compared_generations": len(generations), "mismatches": len(wrong), "mismatch_examples": wrong[:3],
        # the run's engine batches (engine_steps indices, both ends included: its rows of the server's
        # --round-timings file) and its drafter processes' timed rounds, summed (bench/serve_breakdown.py)
        "server_batches": [before.engine_steps + 1, after.engine_steps],
        "drafter_seconds": serve_breakdown.drafter_sums(workers),
        # and each of their requests by its key in that file; add_breakdowns takes it out (not written)
        "drafter_requests": serve_breakdown.drafter_requests(workers),
    }


def _expected(generation: dict, stream: tuple[list[int], str]) -> tuple[list[int], str]:
    """The plain stream cut where the generation stopped (it may be cut by its steps or the deadline)."""
    tokens, finish = stream
    n = len(generation["tokens"])
    return tokens[:n], finish if n == len(tokens) else LENGTH


@contextmanager
def serving(config: ServeConfig, model_dir: Path, extra_args: tuple[str, ...] = (), timings: Path | None = None,
            cohorts: int | None = None):
    """A `python -m verifier serve` subprocess with the load runs' settings, and a client of it;
    with `timings`, the server writes its round timings there when it stops; `cohorts`: its
    --cohorts (None: the first of config.cohorts)."""
    settings = config.server_config(model_dir)
    cohorts = config.cohorts[0] if cohorts is None else cohorts
    if cohorts > 1:
        extra_args = (*extra_args, "--cohorts", str(cohorts))
    if timings is not None:
        extra_args = (*extra_args, ROUND_TIMINGS, str(timings))
    server = ServerProcess(model_dir, device=config.device, dtype=config.served_dtype, n_slots=settings.n_slots,
                           max_seq_len=settings.max_seq_len, max_k=settings.max_k, max_batch_rows=settings.max_batch_rows,
                           extra_args=extra_args)
    try:
        with VerifierClient(server.address, timeout_s=120.0) as client:
            yield server, client
    finally:
        server.stop()


def bench_model(config: ServeConfig, name: str, model_dir: Path, scratch: Path) -> dict:
    """The engine alone, then the service runs, one copy of the model on the device at a time (the
    real-size checkpoint fits one GPU once, not three times): the engine in this process, freed;
    the server with goodput trimming for every run but the untrimmed oracle's, stopped; then the
    untrimmed oracle's server (--no-goodput). With --pairs N each ratio is also measured N - 1
    more times as pairs, alternating which run goes first: random vs plain back to back on the
    first server; oracle trimmed vs untrimmed with the trimmed runs on the first server and the
    untrimmed ones on the second, in the same order (the hosts lent differ from run to run by more
    than the effects measured; the medians of the pairs say how much)."""
    with_goodput_off = server_has_flag(NO_GOODPUT)
    # each server's timestamps file (None: a server without the switch); written when it stops
    timings = {trimmed: scratch / f"round_timings_{name}_{'goodput' if trimmed else 'no_goodput'}.json"
               if server_has_flag(ROUND_TIMINGS, "timings.json") else None for trimmed in (True, False)}
    timed: list[tuple[dict, bool]] = []  # every run, and whether it ran on the first server
    one, more = config.processes, min(2 * config.processes, config.sessions)
    runs: dict[str, dict] = {}
    rss: dict[str, float] = {}
    pairs: dict[str, list[float]] = {"random_vs_plain": [], "oracle_trimmed_vs_untrimmed": []}
    if not with_goodput_off:
        say(f"the server has no {NO_GOODPUT} flag yet: oracle_trimmed_vs_untrimmed is not measured", TAG)
    model_config = load_config(model_dir)  # what GetModelInfo would say: vocabulary and end ids
    plan = workload.Plan(model_config.vocab_size, list(model_config.eos_token_ids), config.k, "none", config.reference_tokens,
                         config.warmup_steps + config.steps, config.seed, sampling_mix="greedy", generations=1)
    engine_figures, streams = engine_alone(config, model_dir, plan)  # before any server: the device holds one model
    oracle = f"oracle K={config.k}"
    oracle_pairs: dict[int, dict] = {}  # pair i of the oracle ratio: its trimmed run now, its untrimmed run on the second server

    def runner(server, client, trimmed: bool):
        def run(label: str, drafter: str = "none", n_processes: int = one, at_start=None, transport: str = FLEET) -> dict:
            figures = service_run(config, server.address, client, dataclasses.replace(plan, drafter=drafter), n_processes,
                                  streams, scratch, f"{name} {label}", at_start, transport)
            timed.append((figures, trimmed))
            return figures
        return run

    with serving(config, model_dir, timings=timings[True]) as (server, client):
        run = runner(server, client, True)
        runs["plain"] = run("plain", at_start=lambda: rss.setdefault("before", server.rss_mib()))
        runs["plain_more_processes"] = run(f"plain, {more} processes", n_processes=more)
        runs["plain_verify_calls"] = run("plain, a Verify call per round", transport=FLEET_VERIFY)
        runs["random"] = run(f"random K={config.k}", "random")
        runs["oracle"] = run(oracle, "oracle")
        _add_pair(pairs["random_vs_plain"], runs["random"], runs["plain"])
        for i in range(2, config.pairs + 1):
            if i % 2 == 0:  # every other pair swaps the order; pair 1 ran the baseline first
                pair = {"drafts": run(f"random K={config.k}, pair {i}", "random"), "baseline": run(f"plain, pair {i}")}
            else:
                pair = {"baseline": run(f"plain, pair {i}"), "drafts": run(f"random K={config.k}, pair {i}", "random")}
            runs[f"random_vs_plain_pair_{i}"] = pair
            _add_pair(pairs["random_vs_plain"], pair["drafts"], pair["baseline"])
            if with_goodput_off:
                oracle_pairs[i] = {"drafts": run(f"{oracle}, pair {i}", "oracle")}
        rss["after"] = server.rss_mib()
    if with_goodput_off:
        _free_device_memory()
        with serving(config, model_dir, (NO_GOODPUT,), timings[False]) as (untrimmed, untrimmed_client):
            run = runner(untrimmed, untrimmed_client, False)
            runs["oracle_untrimmed"] = run(f"{oracle}, {NO_GOODPUT}", "oracle")
            _add_pair(pairs["oracle_trimmed_vs_untrimmed"], runs["oracle"], runs["oracle_untrimmed"])
            for i, pair in oracle_pairs.items():
                pair["baseline"] = run(f"{oracle}, {NO_GOODPUT}, pair {i}", "oracle")
                runs[f"oracle_trimmed_vs_untrimmed_pair_{i}"] = pair
                _add_pair(pairs["oracle_trimmed_vs_untrimmed"], pair["drafts"], pair["baseline"])
    for cohorts in config.cohorts[1:]:  # the same runs with the sessions in other cohorts, a server each
        _free_device_memory()
        with serving(config, model_dir, cohorts=cohorts) as (server, client):
            for key, label, drafter in (("plain", "plain", "none"), ("random", f"random K={config.k}", "random")):
                runs[f"{key}_cohorts_{cohorts}"] = service_run(
                    config, server.address, client, dataclasses.replace(plan, drafter=drafter), one, streams, scratch,
                    f"{name} {label}, --cohorts {cohorts}", None, FLEET)
    add_breakdowns(timed, timings)  # the servers have stopped: their timings files are written
    return model_figures(config, engine_figures, runs, rss, with_goodput_off, pairs)


def add_breakdowns(timed: list[tuple[dict, bool]], timings: dict[bool, Path | None]) -> None:
    """Each run's added_ms_per_round and round breakdown (bench/serve_breakdown.py), from its server's
    timestamps of the run's batches, its drafters' sums and their requests, paired with the server's by key."""
    files = {trimmed: serve_breakdown.load(path) if path is not None else None for trimmed, path in timings.items()}
    for run, trimmed in timed:
        drafted = run.pop("drafter_requests")
        server = files[trimmed]
        if server is None:
            say("a server wrote no round timings: its runs have no breakdown", TAG)
            batches, requests = {}, []
        else:
            batches, requests = serve_breakdown.window(server, *run["server_batches"])
        run.update(serve_breakdown.breakdown(run["ms_per_batch"], batches, requests, run["drafter_seconds"], drafted))


def _add_pair(ratios: list[float], drafts: dict | None, baseline: dict | None) -> None:
    ratio = _ratio(drafts and drafts["tokens_per_s"], baseline and baseline["tokens_per_s"])
    if ratio is not None:
        ratios.append(ratio)


def model_figures(config: ServeConfig, engine: dict, runs: dict[str, dict], rss: dict[str, float],
                  with_goodput_off: bool, pairs: dict[str, list[float]]) -> dict:
    plain = runs["plain"]
    load_runs = [runs[key] for key in ("plain", "plain_more_processes", "plain_verify_calls", "random", "oracle")]
    captures = [r["graph_captures"] for r in load_runs]
    return {
        "sessions": config.sessions,
        "engine_tokens_per_s": engine["tokens_per_s"],
        "service_tokens_per_s": plain["tokens_per_s"],
        "service_over_engine": _ratio(plain["tokens_per_s"], engine["tokens_per_s"]),
        "p50_ms": plain["p50_ms"], "p99_ms": plain["p99_ms"],
        "graph_captures_during_load": None if None in captures else sum(captures),
        "rss_before_mib": _mib(rss.get("before")), "rss_after_mib": _mib(rss.get("after")),
        # the median of the pairs (--pairs; one pair: that pair's ratio)
        "random_drafts_vs_plain_b64": _median(pairs["random_vs_plain"]),
        "oracle_trimmed_vs_untrimmed": _median(pairs["oracle_trimmed_vs_untrimmed"]),
        "pair_ratios": pairs,
        "mismatches": sum(r["mismatches"] for r in _all_runs(runs)),
        "errors": sum(r["errors"] for r in _all_runs(runs)),
        "processes": config.processes,
        "service_tokens_per_s_more_processes": runs["plain_more_processes"]["tokens_per_s"],
        # the drafters' rounds as Verify calls instead of VerifyRounds messages: what the stream saves
        "service_tokens_per_s_verify_calls": runs["plain_verify_calls"]["tokens_per_s"],
        "goodput_flag": with_goodput_off,
        # the plain run's round: what the service adds to the engine step, and where it goes
        # (bench/serve_breakdown.py; every run has its own under runs)
        "added_ms_per_round": plain.get("added_ms_per_round"), "added_ms_per_round_p50": plain.get("added_ms_per_round_p50"),
        "round_breakdown_ms": plain.get("round_breakdown_ms"),
        # the runs above had the sessions in config.cohorts[0] cohorts; each further value's plain and random runs
        "cohorts": config.cohorts[0],
        "other_cohorts": {str(c): {"service_over_engine": _ratio(runs[f"plain_cohorts_{c}"]["tokens_per_s"], engine["tokens_per_s"]),
                                   "random_over_engine": _ratio(runs[f"random_cohorts_{c}"]["tokens_per_s"], engine["tokens_per_s"]),
                                   "p50_ms": runs[f"plain_cohorts_{c}"]["p50_ms"]}
                          for c in config.cohorts[1:]},
        "engine": engine, "runs": runs,
    }


def _all_runs(runs: dict[str, dict]) -> list[dict]:
    """Every service run, the extra pairs' included ({"baseline": run, "drafts": run})."""
    return [r for run in runs.values() for r in (run.values() if "baseline" in run else [run]) if r is not None]


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def _mib(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def _free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- the whole run -----------------------------------------------------------------------------


def run_serve(config: ServeConfig) -> dict:
    from bench.load.remote_pair import remote_drafter

    versions = report.versions()
    result = {"device": device_name("cuda" if config.device == "cuda" else "cpu"), "date": report.today(),
              "torch": versions["torch"], "triton": versions.get("triton"), "versions": versions,
              "settings": {**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)},
                           "dtype": config.served_dtype, "reference_tokens": config.reference_tokens},
              "models": {}, "remote_drafter": None}
    result["settings"] = json.loads(json.dumps(result["settings"], default=str))
    if config.workdir is not None:
        config.workdir.mkdir(parents=True, exist_ok=True)
    config.out.mkdir(parents=True, exist_ok=True)
    path = results_path(config.out, "serve", result["date"], config.name)
    result["path"] = str(path)

    def write() -> None:  # after every model: a later failure keeps what finished
        finished = [m for m in result["models"].values() if "error" not in m]
        result["ok"] = (len(finished) == len(result["models"]) and all(m["mismatches"] == 0 and m["errors"] == 0 for m in finished)
                        and (result["remote_drafter"] is None or bool(result["remote_drafter"].get("streams_equal"))))
        path.write_text(json.dumps({k: v for k, v in result.items() if k != "path"}, indent=1) + "\n")

    with tempfile.TemporaryDirectory(prefix="serve-", dir=config.workdir) as scratch:
        scratch = Path(scratch)
        for name in config.models:
            key = name
            try:
                model_dir = checkpoint(name, scratch, config)
                key = name if name in MODEL_NAMES and name != FP8 else model_dir.name
                result["models"][key] = bench_model(config, key, model_dir, scratch)
            except Exception as exc:  # the models before stand; this one says what failed, and the run goes on
                result["models"][key] = {"error": f"{type(exc).__name__}: {exc}"}
                say(f"{key} failed: {result['models'][key]['error']}", TAG)
            _free_device_memory()
            write()
        if config.remote:
            try:
                result["remote_drafter"] = remote_drafter(config.remote_target, config.remote_draft, config.remote_prompts,
                                                          config.remote_prompt_count, config.remote_new_tokens, config.k,
                                                          config.device, config.served_dtype,
                                                          config.draft_device or config.device, progress=lambda m: say(m, TAG))
            except Exception as exc:
                result["remote_drafter"] = {"error": f"{type(exc).__name__}: {exc}", "streams_equal": False}
                say(f"remote drafter failed: {result['remote_drafter']['error']}", TAG)
            write()
    write()
    return result


def table(result: dict) -> str:
    head = ("model", "engine tok/s", "service tok/s", "svc/engine", "2x procs tok/s", "p50 ms", "p99 ms", "captures",
            "rss MiB", "random/plain", "oracle trim/untrim", "mismatches")
    rows = [head]
    failed = {name: m["error"] for name, m in result["models"].items() if "error" in m}
    for name, m in result["models"].items():
        if name in failed:
            continue
        rows.append((name, m["engine_tokens_per_s"], m["service_tokens_per_s"], m["service_over_engine"],
                     m["service_tokens_per_s_more_processes"], m["p50_ms"], m["p99_ms"], m["graph_captures_during_load"],
                     f"{m['rss_before_mib']}->{m['rss_after_mib']}", m["random_drafts_vs_plain_b64"],
                     m["oracle_trimmed_vs_untrimmed"], m["mismatches"]))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    lines = ["  ".join(str(v).rjust(w) for v, w in zip(row, widths)) for row in rows]
    lines += [f"{name} FAILED: {error}" for name, error in failed.items()]
    for name, m in result["models"].items():
        if name in failed:
            continue
        for c, figures in m.get("other_cohorts", {}).items():
            lines.append(f"{name} with --cohorts {c} (the runs above: {m.get('cohorts', 1)}): service/engine plain "
                         f"{figures['service_over_engine']}, random K {figures['random_over_engine']}, p50 {figures['p50_ms']} ms")
        runs = {key: run for key, run in m["runs"].items() if "baseline" not in run}
        breakdown = serve_breakdown.table(runs)
        if breakdown:
            lines += [f"{name}: a round and its parts, ms (bench/serve_breakdown.py)", breakdown]
    remote = result["remote_drafter"]
    if remote is not None and "error" in remote:
        lines.append(f"remote drafter FAILED: {remote['error']}")
    elif remote is not None:
        lines.append(f"remote drafter K={remote['k']}: plain {remote['plain_tokens_per_s']} tok/s, model drafter "
                     f"{remote['remote_model_tokens_per_s']} tok/s ({remote['remote_model_speedup']}x); in process "
                     f"{remote['inprocess_model_speedup']}x; streams equal: {remote['streams_equal']}; ms per round "
                     f"{remote['ms_per_round']}, of it drafting {remote['drafting_ms_per_round']}, the server's engine "
                     f"{remote['server_engine_ms_per_round']}, the server's step latency {remote['server_latency_ms_per_round']}")
        lines.append(mtp_line(remote))
    return "\n".join(lines)


def mtp_line(remote: dict) -> str:
    """The MTP modes of the remote drafter part, or why they were skipped."""
    if remote.get("mtp_skipped"):
        return f"MTP self-drafting skipped: {remote['mtp_skipped']}"
    equal = remote["streams_equal_by_mode"]
    return (f"MTP K={remote['k']}: through the service {remote['remote_mtp_tokens_per_s']} tok/s "
            f"({remote['remote_mtp_speedup']}x plain), mean acceptance length {remote['remote_mtp_mean_acceptance_length']}; "
            f"in process {remote['inprocess_mtp_tokens_per_s']} tok/s ({remote['inprocess_mtp_speedup']}x), "
            f"{remote['inprocess_mtp_mean_acceptance_length']}; streams equal to plain: "
            f"{equal['remote_mtp']} / {equal['inprocess_mtp']}")


def build_parser() -> argparse.ArgumentParser:
    defaults = argparse.Namespace(**{f.name: f.default for f in dataclasses.fields(ServeConfig)})
    p = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="directory for serve_<date>[_<name>].json")
    p.add_argument("--model", default=",".join(defaults.models),
                   help=f"comma-separated: {', '.join(MODEL_NAMES)} or a checkpoint directory")
    p.add_argument("--device", default=defaults.device, choices=["cpu", "cuda"], help="where the server and the engine run")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="served dtype; None: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--sessions", type=int, default=defaults.sessions, help="sessions (and sequences of the engine's batch)")
    p.add_argument("--processes", type=int, default=defaults.processes, help="drafter processes (a second plain run uses twice as many)")
    p.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps, help="untimed steps (engine) or rounds (service) first")
    p.add_argument("--steps", type=int, default=defaults.steps, help="timed steps per sequence")
    p.add_argument("--k", type=int, default=defaults.k, help="drafts per step of the random, oracle, model and MTP drafters")
    p.add_argument("--quick", action="store_true", help=f"shorter, overriding those flags: {QUICK}")
    p.add_argument("--no-remote", action="store_true", help="skip the remote drafter part")
    p.add_argument("--remote-target", type=Path, default=defaults.remote_target, help="the pair's target checkpoint")
    p.add_argument("--remote-draft", type=Path, default=defaults.remote_draft, help="the pair's draft checkpoint")
    p.add_argument("--remote-prompts", type=Path, default=defaults.remote_prompts, help="JSONL of held-out prompts")
    p.add_argument("--remote-prompt-count", type=int, default=defaults.remote_prompt_count, help="prompts used, from the first")
    p.add_argument("--remote-new-tokens", type=int, default=defaults.remote_new_tokens, help="tokens per remote generation")
    p.add_argument("--draft-device", default=None, help="where the model drafter runs; None: --device")
    p.add_argument("--time-limit-s", type=float, default=defaults.time_limit_s, help="per service run: stop its sessions then")
    p.add_argument("--seed", type=int, default=defaults.seed, help="seed of the prompts and the random drafts")
    p.add_argument("--pairs", type=int, default=defaults.pairs,
                   help="pairs per ratio (random vs plain back to back, oracle trimmed vs untrimmed on its two servers), alternating "
                        "which runs first; the median ratio is reported")
    p.add_argument("--name", default=defaults.name, help=NAME_HELP)
    p.add_argument("--fp8-config", default=defaults.fp8_config, help=f"--model {FP8}: the published config written "
                   "(bench.fp8_real_size's --config)")
    p.add_argument("--fp8-scale", default=defaults.fp8_scale, choices=["full", "tiny"],
                   help=f"--model {FP8}: published sizes, or shrunk for the CPU")
    p.add_argument("--cohorts", type=lambda v: tuple(int(c) for c in v.split(",") if c), default=defaults.cohorts,
                   help="comma-separated --cohorts of the servers (sessions in groups whose batches take turns on the "
                        "engine): every run with the first, a plain and a random-drafts run with each further one")
    p.add_argument("--workdir", type=Path, default=None, help="where the temporary checkpoints are written (the full-size "
                   "FP8 one takes 36 GB); None: the system's temporary folder")
    return p


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    quick, remote_off, models = args.pop("quick"), args.pop("no_remote"), args.pop("model")
    if quick:
        args.update(QUICK)
    try:
        config = ServeConfig(**args, models=tuple(m.strip() for m in models.split(",") if m.strip()), remote=not remote_off)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = run_serve(config)
    say(f"wrote {result['path']}", TAG)
    print(table(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
