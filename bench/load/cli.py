"""`python -m bench.load`: start the verifier, run the drafter processes, check every stream
against plain decoding, check that slots and memory come back, write load_<date>.json."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

from drafter.client import VerifierClient
from drafter.loop import STREAM, UNARY

from bench.machine import NAME_HELP, check_name, device_name
from presets.bench_models import TINY_CONFIG, TINY_EMBED_STD, TINY_NAME

from . import processes, reference, report, workload
from .drafters import FLEET, FLEET_VERIFY
from .progress import StepProgress, say
from .server import ServerProcess

TRANSPORTS = (FLEET, FLEET_VERIFY, STREAM, UNARY)
LOAD_DRAFTERS = ("ngram", "random", "mixed", "none")  # the oracle needs plain streams first: bench.serve has them

WARMUP_STEPS = 3


@dataclasses.dataclass(frozen=True)
class LoadConfig:
    out: Path
    model: Path | None = None  # None: TINY_CONFIG's checkpoint, written to a temporary directory
    server: str | None = None  # HOST:PORT of a running verifier (then --model names its checkpoint)
    sessions: int = 64
    processes: int = 4
    steps: int = 300
    k: int = 4
    drafter: str = "mixed"
    sampling: str = "mixed"  # workload.SAMPLING_MIXES: half greedy, half seeded sampling; or all greedy
    device: str = "cpu"
    dtype: str = "float32"
    transport: str = FLEET
    goodput: bool = True  # False: the server started here verifies every draft (--no-goodput)
    time_limit_s: float = 900.0
    max_new_tokens: int = 128
    seed: int = 0
    name: str = ""  # what differs from the default run, appended to the results file's name

    def __post_init__(self):
        check_name(self.name)
        if self.sessions < 1 or self.processes < 1 or self.processes > self.sessions:
            raise ValueError(f"need 1 <= processes <= sessions, got processes {self.processes}, sessions {self.sessions}")
        if self.server is not None and self.model is None:
            raise ValueError("--server needs --model: the checkpoint it serves, for plain decoding here")
        if self.transport not in TRANSPORTS or self.drafter not in LOAD_DRAFTERS:
            raise ValueError(f"transport must be one of {TRANSPORTS} and drafter one of {LOAD_DRAFTERS}, got "
                             f"{self.transport!r}, {self.drafter!r}")
        if self.time_limit_s <= 0:
            raise ValueError(f"time_limit_s must be > 0, got {self.time_limit_s}")


def run_drafters(address: str, plan: workload.Plan, config: LoadConfig, deadline: float, scratch: Path) -> list[dict]:
    return processes.run_drafters(address, plan, processes.shares(config.sessions, config.processes), config.transport,
                                  deadline, scratch)


def run_load(config: LoadConfig) -> dict:
    with tempfile.TemporaryDirectory(prefix="load-") as scratch:
        scratch = Path(scratch)
        model_dir, model_name = config.model, config.model.name if config.model else TINY_NAME
        if model_dir is None:
            from verifier.model.random_checkpoint import write_random_checkpoint

            model_dir = write_random_checkpoint(TINY_CONFIG, scratch / TINY_NAME, seed=0, std=TINY_EMBED_STD)
        max_seq_len = workload.PROMPT_MAX + config.max_new_tokens + config.k + 1
        server = None
        if config.server is None:
            server = ServerProcess(model_dir, device=config.device, dtype=config.dtype, n_slots=config.sessions,
                                   max_seq_len=max_seq_len, max_k=config.k,
                                   extra_args=() if config.goodput else ("--no-goodput",))
        address = config.server or server.address
        try:
            with VerifierClient(address, timeout_s=60.0) as client:
                info = client.model_info()
                plan = workload.Plan(info.vocab_size, info.eos_ids, config.k, config.drafter, config.max_new_tokens,
                                     config.steps, config.seed, sampling_mix=config.sampling)
                # Warm-up at full width: the first batches grow the allocator's pools, which is not a leak.
                with StepProgress(address, config.sessions * WARMUP_STEPS, "warm-up"):
                    warm = run_drafters(address, dataclasses.replace(plan, steps=WARMUP_STEPS), config, time.time() + 300,
                                        scratch)
                before, rss_before = client.stats(), server.rss_mib() if server else None
                with StepProgress(address, config.sessions * config.steps, "load"):
                    workers = run_drafters(address, plan, config, time.time() + config.time_limit_s, scratch)
                after, rss_after = client.stats(), server.rss_mib() if server else None
        finally:
            server_rc = server.stop() if server is not None else None
        generations = [g for w in warm + workers for g in w["generations"]]
        say(f"plain decoding of {len(generations)} generations to compare against")
        plain = reference.plain_streams(model_dir, config.device, config.dtype, generations, config.sessions,
                                        info.max_context, info.max_k, progress=say)
        wrong = reference.mismatches(generations, plain)
    figures, served = report.step_figures(workers), report.server_figures(before, after)
    warm_errors = report.step_figures(warm)["errors"]
    rss_ok = rss_before is None or rss_after - rss_before <= report.RSS_TOLERANCE_MIB
    slots_ok = served["free_slots_after"] == served["free_slots_before"] and served["open_sessions_after"] == 0
    versions = report.versions()
    result = {
        "date": report.today(), "model": model_name, "model_type": info.model_type, "layer_kinds": list(info.layer_kinds),
        "device": info.device, "dtype": config.dtype, "machine": device_name("cuda" if config.device == "cuda" else "cpu"),
        "versions": versions, "torch": versions["torch"],
        "sessions": config.sessions, "processes": config.processes, "steps_per_session": config.steps, "k": config.k,
        "drafter": config.drafter, "sampling": config.sampling, "transport": config.transport, "goodput": config.goodput,
        "max_new_tokens": config.max_new_tokens,
        "time_limit_s": config.time_limit_s, "seed": config.seed,
        **figures, "warmup_errors": warm_errors, **served,
        "compared_generations": len(generations), "compared_tokens": sum(len(g["tokens"]) for g in generations),
        "mismatches": len(wrong), "mismatch_examples": wrong[:5],
        "server_pid_rss": server is not None, "rss_before_mib": None if rss_before is None else round(rss_before, 1),
        "rss_after_mib": None if rss_after is None else round(rss_after, 1), "rss_tolerance_mib": report.RSS_TOLERANCE_MIB,
        "rss_back_to_baseline": rss_ok, "free_slots_back_to_baseline": slots_ok, "server_exit_code": server_rc,
    }
    result["errors"] += warm_errors
    result["ok"] = result["errors"] == 0 and not wrong and rss_ok and slots_ok and server_rc in (None, 0)
    result["path"] = str(report.write(config.out, result, config.name))
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="directory for load_<date>[_<name>].json")
    p.add_argument("--model", type=Path, default=None, help="checkpoint to serve; None: a tiny random one")
    p.add_argument("--server", default=None, help="HOST:PORT of a running verifier; None: start one")
    p.add_argument("--sessions", type=int, default=64, help="concurrent sessions in all")
    p.add_argument("--processes", type=int, default=4, help="drafter processes sharing the sessions")
    p.add_argument("--steps", type=int, default=300, help="verify steps per session")
    p.add_argument("--k", type=int, default=4, help="drafts per step")
    p.add_argument("--drafter", default="mixed", choices=LOAD_DRAFTERS,
                   help="mixed: n-gram for even sessions, random for odd ones; none: plain decoding")
    p.add_argument("--sampling", default="mixed", choices=workload.SAMPLING_MIXES,
                   help="mixed: half the sessions greedy, half seeded sampling with top-k / top-p; greedy: all greedy")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the server and plain decoding run")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the served weights' dtype")
    p.add_argument("--transport", default=FLEET, choices=TRANSPORTS,
                   help="fleet: one request per round for all of a process's sessions, on one VerifyRounds stream "
                        "(drafter/fleet.py); fleet-verify: the same as one Verify call per round; "
                        "stream / unary: per session, a VerifyStream or one Verify call per step")
    p.add_argument("--no-goodput", dest="goodput", action="store_false",
                   help="start the server with --no-goodput: every draft verified, so accepted prefixes of every length "
                        "roll back under load")
    p.add_argument("--time-limit-s", type=float, default=900.0, help="stop the sessions then and report what was done")
    p.add_argument("--max-new-tokens", type=int, default=128, help="per generation; a session reopens until its steps are done")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts, samplings and random drafts")
    p.add_argument("--name", default="", help=NAME_HELP)
    return p


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    try:
        config = LoadConfig(**args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = run_load(config)
    print(report.summary(result))
    if result["mismatch_examples"]:
        print(f"first mismatches: {result['mismatch_examples']}", file=sys.stderr)
    return 0 if result["ok"] else 1
