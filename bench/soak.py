"""The soak: the verifier under load for minutes, drafter processes killed and restarted at random,
then stopped under full load. What a long run under real clients must show: nothing lost, nothing
leaked, the bits unchanged.
How it measures, what it checks and writes: bench/README.md, Methods, `bench.soak`.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from bench.load import reference, workload
from bench.load.drafters import FLEET
from bench.load.progress import say
from bench.load.report import RSS_TOLERANCE_MIB, today, versions
from bench.load.server import REPO, ServerProcess, rss_mib
from bench.machine import NAME_HELP, check_name, device_name, results_path
from drafter.client import VerifierClient
from verifier.arguments import OneLineErrors
from verifier.model.hf_config import load_config

TAG = "soak"
MODELS = ("2b", "shipped", "tiny")
IDLE_TIMEOUT_S = 5.0  # the server's --idle-timeout-s: a killed drafter's sessions come back this soon
KILL_GAP_S = IDLE_TIMEOUT_S + 2.0  # the least time between kills: the last one's sessions are reaped first
MEMORY_TOLERANCE = 0.02  # end vs steady: flat within 2% (RSS also within RSS_TOLERANCE_MIB, allocator noise)
GPU_TOLERANCE_MIB = 64.0
FOREVER_STEPS = 10**9  # a session runs generations until the phase's deadline


@dataclass(frozen=True)
class SoakConfig:
    out: Path
    model: str = "2b"
    device: str = "cuda"
    dtype: str | None = None
    sessions: int = 64
    processes: int = 4
    minutes: float = 10.0
    kill_every_s: float = 20.0
    settle_s: float = 30.0
    stop_after_s: float = 10.0
    max_new_tokens: int = 64
    k: int = 4
    seed: int = 0
    name: str = ""

    def __post_init__(self):
        check_name(self.name)
        if self.model not in MODELS and not Path(self.model).is_dir():
            raise ValueError(f"--model must be one of {MODELS} or a checkpoint directory, got {self.model!r}")
        if self.model == "2b" and self.device != "cuda":
            raise ValueError("--model 2b needs --device cuda")
        if not 1 <= self.processes <= self.sessions:
            raise ValueError(f"need 1 <= --processes <= --sessions, got {self.processes}, {self.sessions}")
        if self.minutes <= 0 or self.kill_every_s <= 0 or self.stop_after_s <= 0 or self.settle_s < 0:
            raise ValueError("--minutes, --kill-every-s and --stop-after-s must be > 0, --settle-s >= 0")
        if self.settle_s >= self.minutes * 60:
            raise ValueError(f"--settle-s {self.settle_s:g} must be shorter than the soak ({self.minutes:g} min)")

    @property
    def served_dtype(self) -> str:
        return self.dtype or ("bfloat16" if self.device == "cuda" else "float32")


def checkpoint(name: str, scratch: Path) -> Path:
    from bench.serve import ServeConfig
    from bench.serve import checkpoint as serve_checkpoint

    return serve_checkpoint(name, scratch, ServeConfig(out=scratch, models=(name,), device="cuda" if name == "2b" else "cpu"))


class Drafters:
    """The drafter processes of a phase: started over shares of the sessions, killed and restarted,
    and collected (what a killed incarnation did is gone with it: only the survivors report)."""

    def __init__(self, address: str, plan: workload.Plan, shares: list[list[int]], deadline: float, scratch: Path, phase: str):
        self.address, self.plan, self.shares, self.deadline, self.scratch, self.phase = address, plan, shares, deadline, scratch, phase
        self.incarnations = [0] * len(shares)
        self.procs: list[tuple[subprocess.Popen, Path, Path]] = [self._start(p) for p in range(len(shares))]
        self.kills = 0

    def _start(self, p: int) -> tuple[subprocess.Popen, Path, Path]:
        stem = self.scratch / f"{self.phase}.drafter{p}.{self.incarnations[p]}"
        cfg, out, err = (Path(f"{stem}.{suffix}") for suffix in ("json", "out.json", "err.txt"))
        # a restarted process's prompts differ from its last incarnation's: the plan's seed moves
        plan = workload.Plan(**{**self.plan.to_json(), "eos_ids": self.plan.eos_ids, "seed": self.plan.seed + 1000 * self.incarnations[p]})
        cfg.write_text(json.dumps({"address": self.address, "plan": plan.to_json(), "sessions": self.shares[p],
                                   "deadline": self.deadline, "transport": FLEET}))
        with open(err, "w") as stderr:
            proc = subprocess.Popen([sys.executable, "-m", "bench.load.drafters", str(cfg), str(out)], cwd=REPO,
                                    stdout=subprocess.DEVNULL, stderr=stderr)
        return proc, out, err

    def kill_one(self, rng: random.Random) -> None:
        p = rng.randrange(len(self.procs))
        proc, _, _ = self.procs[p]
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            self.kills += 1
        self.incarnations[p] += 1
        self.procs[p] = self._start(p)

    def collect(self, hang_s: float = 180.0) -> tuple[list[dict], list[str]]:
        """(each survivor's report, why each process that was not killed failed)."""
        reports, failures = [], []
        for proc, out, err in self.procs:
            try:
                proc.wait(timeout=max(1.0, self.deadline - time.time()) + hang_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.returncode == 0 and out.is_file():
                reports.append(json.loads(out.read_text()))
            else:
                failures.append(f"drafter process {proc.pid} exited {proc.returncode}: {err.read_text()[-500:]}")
        return reports, failures


def gpu_mib(pid: int) -> float | None:
    """GPU memory a process holds (nvidia-smi), None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0] == str(pid):
            return float(fields[1])
    return None


def memory(server: ServerProcess) -> dict:
    return {"rss_mib": round(server.rss_mib(), 1), "gpu_mib": gpu_mib(server.pid)}


def flat(start: dict, end: dict) -> bool:
    rss_ok = end["rss_mib"] <= start["rss_mib"] * (1 + MEMORY_TOLERANCE) or end["rss_mib"] - start["rss_mib"] <= RSS_TOLERANCE_MIB
    gpu_ok = start["gpu_mib"] is None or end["gpu_mib"] is None or end["gpu_mib"] - start["gpu_mib"] <= max(
        GPU_TOLERANCE_MIB, start["gpu_mib"] * MEMORY_TOLERANCE)
    return rss_ok and gpu_ok


def tally(reports: list[dict]) -> dict:
    errors: Counter[str] = Counter()
    for r in reports:
        errors.update(r["errors"])
    return {"steps": sum(len(r["latencies_ms"]) for r in reports), "tokens": sum(r["tokens"] for r in reports),
            "generations": sum(len(r["generations"]) for r in reports), "errors_by_code": dict(errors)}


def run_soak(config: SoakConfig) -> dict:
    rng = random.Random(config.seed)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        scratch = Path(tmp)
        model_dir = checkpoint(config.model, scratch) if config.model in MODELS else Path(config.model)
        model_config = load_config(model_dir)
        plan = workload.Plan(vocab_size=model_config.vocab_size, eos_ids=tuple(model_config.eos_token_ids), k=config.k,
                             drafter="mixed", max_new_tokens=config.max_new_tokens, steps=FOREVER_STEPS, seed=config.seed)
        max_seq_len = workload.PROMPT_MAX + config.max_new_tokens + config.k + 1
        shares = [list(range(p * config.sessions // config.processes, (p + 1) * config.sessions // config.processes))
                  for p in range(config.processes)]
        # a restarted process reopens its sessions while the killed one's still hold their slots (until
        # reaped): one share's slots more than the sessions, and kills at least KILL_GAP_S apart
        n_slots = config.sessions + max(map(len, shares))
        server = ServerProcess(model_dir, device=config.device, dtype=config.served_dtype, n_slots=n_slots,
                               max_seq_len=max_seq_len, max_k=config.k, extra_args=("--idle-timeout-s", f"{IDLE_TIMEOUT_S:g}"))
        say(f"verifier on {model_dir} ({config.device}, {config.served_dtype}, {n_slots} slots) at {server.address}", TAG)
        result: dict = {"device": device_name(config.device), "date": today(), "versions": versions(),
                        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in config.__dict__.items()},
                        "model_dir": str(model_dir), "idle_timeout_s": IDLE_TIMEOUT_S}
        try:
            # 1. the soak, with kills
            started = time.time()
            deadline = started + config.minutes * 60
            say(f"soak: {config.processes} drafter processes, {config.sessions} sessions, {config.minutes:g} min, "
                f"a kill every {config.kill_every_s:g} s on average", TAG)
            soak = Drafters(server.address, plan, shares, deadline, scratch, "soak")
            steady = None
            next_kill = started + rng.expovariate(1 / config.kill_every_s)
            while time.time() < deadline:
                now = time.time()
                if steady is None and now - started >= config.settle_s:
                    steady = memory(server)
                    say(f"steady: {steady}", TAG)
                if now >= next_kill:
                    soak.kill_one(rng)
                    next_kill = now + max(KILL_GAP_S, rng.expovariate(1 / config.kill_every_s))
                time.sleep(min(1.0, max(0.0, min(next_kill, deadline) - time.time())))
            soak_reports, soak_failures = soak.collect()
            result["soak"] = {**tally(soak_reports), "kills": soak.kills, "failed_processes": soak_failures,
                              "seconds": round(time.time() - started, 1)}
            say(f"soak done: {result['soak']['steps']} steps reported by survivors, {soak.kills} kills", TAG)
            # 2. idle: every slot back once the killed drafters' sessions are reaped
            time.sleep(IDLE_TIMEOUT_S + 2.0)
            with VerifierClient(server.address) as client:
                stats = client.stats()
            end = memory(server)
            result["idle"] = {"open_sessions": stats.open_sessions, "free_slots": stats.free_slots, "n_slots": n_slots,
                              "server_steps": stats.steps, "server_errors": stats.errors}
            result["memory"] = {"steady": steady, "end": end}
            say(f"idle: {stats.open_sessions} sessions open, {stats.free_slots}/{n_slots} slots free; memory {end}", TAG)
            # 3. SIGTERM under full load
            stop = Drafters(server.address, workload.Plan(**{**plan.to_json(), "eos_ids": plan.eos_ids, "seed": plan.seed + 7}),
                            shares, time.time() + config.stop_after_s + 120, scratch, "stop")
            time.sleep(config.stop_after_s)
            say("SIGTERM under full load", TAG)
            exit_status = server.stop()
            stop_reports, stop_failures = stop.collect()
            result["stop"] = {**tally(stop_reports), "server_exit_status": exit_status, "failed_processes": stop_failures}
        finally:
            server.stop()
        # every reported generation against plain decoding
        generations = [g for r in soak_reports + stop_reports for g in r["generations"] if g["tokens"]]
        say(f"plain decoding of {len(generations)} generations for the comparison", TAG)
        plain = reference.plain_streams(model_dir, config.device, config.served_dtype, generations, n_slots=config.sessions,
                                        max_seq_len=max_seq_len, max_k=config.k, progress=lambda line: say(line, TAG))
        found = reference.mismatches(generations, plain)
    errors = Counter(result["soak"]["errors_by_code"]) + Counter(result["stop"]["errors_by_code"])
    result.update(compared_generations=len(generations), mismatches=len(found), first_mismatches=found[:5],
                  tokens_lost=errors.get("ABORTED", 0), cancelled=errors.get("CANCELLED", 0))
    checks = {
        "no mismatch": not found,
        "no token lost": result["tokens_lost"] == 0,
        "no call CANCELLED": result["cancelled"] == 0,
        "only UNAVAILABLE at the stop": set(result["stop"]["errors_by_code"]) <= {"UNAVAILABLE"},
        "no error in the surviving streams": not result["soak"]["errors_by_code"],
        "no surviving drafter process failed": not result["soak"]["failed_processes"] and not result["stop"]["failed_processes"],
        "no slot held after the last close": result["idle"]["open_sessions"] == 0 and result["idle"]["free_slots"] == result["idle"]["n_slots"],
        "memory flat": result["memory"]["steady"] is not None and flat(result["memory"]["steady"], result["memory"]["end"]),
        "the server exited 0 on SIGTERM": result["stop"]["server_exit_status"] == 0,
    }
    result["checks"] = checks
    result["ok"] = all(checks.values())
    return result


def summary(result: dict) -> str:
    failed = [name for name, ok in result["checks"].items() if not ok]
    return (f"soak: {result['soak']['steps']} + {result['stop']['steps']} steps, {result['soak']['kills']} kills, "
            f"{result['compared_generations']} generations compared, {result['mismatches']} mismatches, "
            f"{result['tokens_lost']} lost, {result['cancelled']} cancelled; slots free {result['idle']['free_slots']}/"
            f"{result['idle']['n_slots']}; memory {result['memory']['steady']} -> {result['memory']['end']}: "
            + ("PASS" if result["ok"] else f"FAIL ({', '.join(failed)})"))


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    defaults = SoakConfig(out=Path("."))
    parser.add_argument("--out", type=Path, required=True, help="results directory")
    parser.add_argument("--model", default=defaults.model, help=f"one of {MODELS}, or a checkpoint directory")
    parser.add_argument("--device", default=defaults.device, choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on the CPU")
    for field in ("sessions", "processes", "max_new_tokens", "k", "seed"):
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, default=getattr(defaults, field))
    for field in ("minutes", "kill_every_s", "settle_s", "stop_after_s"):
        parser.add_argument(f"--{field.replace('_', '-')}", type=float, default=getattr(defaults, field))
    parser.add_argument("--name", default="", help=NAME_HELP)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = SoakConfig(**{k: v for k, v in vars(args).items()})
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = run_soak(config)
    path = results_path(config.out, "soak", result["date"], config.name)
    config.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    say(f"wrote {path}", TAG)
    print(summary(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
