"""The acceptance-rate bench (`python -m drafter bench`): every prompt through one verifier server,
first by plain decoding (the reference stream and the plain tokens/s), then once per drafter and K;
one row of figures per (drafter, K), written to DIR/results.json.
The design in full: DESIGN.md section 8, "The acceptance bench".
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from verifier.params import SamplingParams
from verifier.proposers import ProbabilityProposer, Proposer

from .adaptive import AdaptiveK
from .bench_stats import Counts, count, figures
from .choose import check_server_offers, server_drafter
from .limits import check_budget, check_k
from .loop import generate
from .messages import ModelInfo

ADAPTIVE = "adaptive"  # the k of a row whose loop adapts K per sequence (up to the largest K)
EXACT, REJECTION = "exact", "rejection"  # how a row's drafts were judged (see above)


@dataclass(frozen=True)
class Prompt:
    prompt_ids: list[int] | None = None
    text: str | None = None


def load_prompts(path: str | Path) -> list[Prompt]:
    """A JSONL file, one prompt a line: {"prompt_ids": [ints]} or {"text": "..."}; blank lines skipped."""
    prompts = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not JSON ({err.msg})") from None
        if not isinstance(item, dict) or ("prompt_ids" in item) == ("text" in item):
            raise ValueError(f"{where}: needs exactly one of prompt_ids and text")
        if "text" in item:
            if not isinstance(item["text"], str) or not item["text"]:
                raise ValueError(f"{where}: text must be a non-empty string")
            prompts.append(Prompt(text=item["text"]))
        else:
            ids = item["prompt_ids"]
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError(f"{where}: prompt_ids must be a non-empty list of integers")
            prompts.append(Prompt(prompt_ids=ids))
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def check_prompts(prompts: list[Prompt], info: ModelInfo, max_new_tokens: int) -> None:
    """Refuse, naming the prompt, what the served model cannot take (before anything is timed). A
    text prompt's length is known once the server tokenizes it: its budget is checked at its open."""
    for i, prompt in enumerate(prompts):
        if prompt.prompt_ids is not None:
            bad = [t for t in prompt.prompt_ids if not 0 <= t < info.vocab_size]
            if bad:
                raise ValueError(f"prompt {i}: prompt_ids {bad[:5]} are outside the served model's vocabulary 0..{info.vocab_size - 1}")
            check_budget(max_new_tokens, info, len(prompt.prompt_ids), where=f"prompt {i}: ")
        elif not info.has_tokenizer:
            raise ValueError(f"prompt {i}: text, but the served model {info.model_id!r} has no tokenizer; use prompt_ids")
        else:
            check_budget(max_new_tokens, info, None, where=f"prompt {i}: ")


@dataclass
class Run:
    """One (drafter, k) over every prompt."""

    drafter: str
    k: int | str  # drafts per step, or ADAPTIVE
    max_k: int  # the most drafts a step could carry: sizes the per-position lists
    counts: Counts = field(default_factory=Counts)
    tokens: int = 0  # generated, over every prompt
    seconds: float = 0.0
    mismatched: list[int] = field(default_factory=list)  # prompts whose stream differs from plain
    acceptance: str = EXACT  # REJECTION once any step carried draft probabilities
    trimmed_drafts: int = 0  # drafts the server did not verify during the row (Stats.trimmed_drafts, server-wide)

    @property
    def failed(self) -> bool:
        """A stream differs from plain decoding where the contract says it must not."""
        return bool(self.mismatched) and self.acceptance == EXACT

    def row(self, plain_tokens_per_s: float | None) -> dict:
        f = figures(self.counts)
        rate = self.tokens / self.seconds if self.seconds > 0 else None
        return {
            "drafter": self.drafter,
            "k": self.k,
            "mean_acceptance_length": f.mean_acceptance_length,
            "acceptance_rate": f.acceptance_rate,
            "token_acceptance_probability": f.token_acceptance_probability,
            "per_position_acceptance": f.per_position_acceptance,
            "tokens_per_step": f.tokens_per_step,
            "tokens_per_s": rate,
            "speedup_vs_plain": rate / plain_tokens_per_s if rate and plain_tokens_per_s else None,
            "streams_match_plain": not self.mismatched,
            "acceptance": self.acceptance,
            "mismatched_prompts": list(self.mismatched),
            "tokens": self.tokens,
            "seconds": self.seconds,
            "steps": self.counts.steps,
            "drafts": self.counts.drafts,
            "draft_tokens": self.counts.draft_tokens,
            "accepted_tokens": self.counts.accepted_tokens,
            "rejected_steps": self.counts.rejections,
            "drafted_per_position": list(self.counts.drafted_at),
            "accepted_per_position": list(self.counts.accepted_at),
            "trimmed_drafts": self.trimmed_drafts,
        }


@dataclass
class Plain:
    """The reference: each prompt by plain decoding."""

    tokens: list[list[int]]
    finish_reasons: list[str]
    prompt_tokens: list[int]
    seconds: float

    @property
    def tokens_per_s(self) -> float | None:
        return sum(map(len, self.tokens)) / self.seconds if self.seconds > 0 else None


ProposerFactory = Callable[[str], "Proposer | None"]  # drafter name -> a fresh proposer for one sequence


def run_bench(client, info: ModelInfo, prompts: list[Prompt], drafters: list[str], ks: list[int], *,
              max_new_tokens: int, sampling: SamplingParams, make_proposer: ProposerFactory, adaptive: bool = False,
              progress: bool = True, allow_trimming: bool = False) -> tuple[Plain, list[Run]]:
    """Plain decoding of every prompt, then every (drafter, k) over every prompt (and, with
    `adaptive`, one adaptive-K row per drafter). Sessions ask for every draft to be verified unless
    `allow_trimming` (see DESIGN.md section 8, "The acceptance bench"). Raises VerifierError when the server refuses."""
    verify_all = not allow_trimming
    if any(k < 1 for k in ks):
        raise ValueError(f"--k values must be >= 1, got {ks}")
    if info.max_k < 1:
        raise ValueError(f"the server takes no drafts (its max_k is {info.max_k}): nothing to bench")
    check_k(max(ks), info)
    check_prompts(prompts, info, max_new_tokens)
    for drafter in drafters:
        if server_drafter(drafter):
            check_server_offers(server_drafter(drafter), info, f"--drafter {drafter}")
    plans = [(d, 0) if d == "none" else (d, k) for d in drafters for k in (ks[:1] if d == "none" else ks)]
    if adaptive:  # a server drafter's K is fixed at the open: nothing to adapt
        plans += [(d, ADAPTIVE) for d in drafters if d != "none" and not server_drafter(d)]
    with tqdm(total=len(prompts) * (1 + len(plans)), desc="bench", unit="run", file=sys.stderr, disable=not progress) as bar:
        _generate(client, info, prompts[0], None, 0, min(max_new_tokens, 8), sampling)  # warm-up, not timed
        plain = _plain(client, info, prompts, max_new_tokens, sampling, bar)
        runs = []
        for drafter, k in plans:
            bar.set_postfix_str(f"{drafter} k={k}")
            run = Run(drafter, k, max(ks) if k == ADAPTIVE else k)
            trimmed_before = client.stats().trimmed_drafts
            for i, prompt in enumerate(prompts):
                proposer = _watch(make_proposer(drafter), sampling)  # built before the clock starts: a model drafter loads
                start = time.perf_counter()
                gen = _generate(client, info, prompt, proposer, k, max_new_tokens, sampling, max_k=run.max_k,
                                verify_all=verify_all, server=server_drafter(drafter))
                run.seconds += time.perf_counter() - start
                if isinstance(proposer, _ProbabilityWatch) and proposer.sent:
                    run.acceptance = REJECTION
                run.tokens += len(gen.tokens)
                run.counts += count(gen.accepted_per_step, gen.drafted_per_step, len(gen.tokens) - 1, run.max_k)
                if gen.tokens != plain.tokens[i] or gen.finish_reason != plain.finish_reasons[i]:
                    run.mismatched.append(i)
                bar.update()
            run.trimmed_drafts = client.stats().trimmed_drafts - trimmed_before
            runs.append(run)
    return plain, runs


def _plain(client, info, prompts, max_new_tokens, sampling, bar) -> Plain:
    plain = Plain([], [], [], 0.0)
    bar.set_postfix_str("plain")
    for prompt in prompts:
        start = time.perf_counter()
        gen = _generate(client, info, prompt, None, 0, max_new_tokens, sampling)
        plain.seconds += time.perf_counter() - start
        plain.tokens.append(gen.tokens)
        plain.finish_reasons.append(gen.finish_reason)
        plain.prompt_tokens.append(len(gen.prompt_ids))
        bar.update()
    return plain


def _generate(client, info, prompt: Prompt, proposer, k, max_new_tokens, sampling, max_k: int = 0, verify_all: bool = False,
              server: str = ""):
    """One generation; a text prompt that the server tokenizes past the context is refused at its open.
    `server`: the server drafter that drafts it (proposer None), "" when `proposer` drafts."""
    adaptive = None
    if k == ADAPTIVE:  # a fresh rule per sequence: it learns from that sequence's steps alone
        k, adaptive = max_k, AdaptiveK(max_k)
    return generate(client, proposer, prompt_ids=prompt.prompt_ids, text=prompt.text, max_new_tokens=max_new_tokens,
                    sampling=sampling, k=k, info=info, adaptive=adaptive, verify_all_drafts=verify_all, server_drafter=server,
                    on_open=lambda session: check_budget(max_new_tokens, info, len(session.prompt_ids),
                                                         where=f"{prompt.text[:20]!r}: " if prompt.text else ""))


class _ProbabilityWatch:
    """A probability proposer, passed through, that notes whether it gave the loop draft
    probabilities for a sampled session (the loop then sends them: rejection sampling)."""

    def __init__(self, inner, sampled: bool):
        self.inner, self.sampled, self.sent = inner, sampled, False

    def propose(self, context: list[int], k: int) -> list[int]:
        return self.inner.propose(context, k)

    def propose_with_probs(self, context: list[int], k: int):
        drafts, probs = self.inner.propose_with_probs(context, k)
        self.sent |= self.sampled and probs is not None and len(drafts) > 0
        return drafts, probs


def _watch(proposer, sampling: SamplingParams):
    return _ProbabilityWatch(proposer, sampling.temperature > 0) if isinstance(proposer, ProbabilityProposer) else proposer


def results(server: str, info: ModelInfo, prompts_file: str, plain: Plain, runs: list[Run], max_new_tokens: int,
            sampling: SamplingParams, allow_trimming: bool = False) -> dict:
    """The results.json object."""
    return {
        # on: the server's policy could verify fewer drafts than were sent (the figures count verified ones)
        "trimming": {"on": info.trims_drafts and allow_trimming, "server_trims_drafts": info.trims_drafts,
                     "verify_all_drafts": not allow_trimming,
                     "trimmed_drafts": sum(run.trimmed_drafts for run in runs)},
        "server": server,
        "model_id": info.model_id,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "max_new_tokens": max_new_tokens,
        "sampling": {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
                     "seed": sampling.seed},
        "prompts": {"file": str(prompts_file), "count": len(plain.tokens), "prompt_tokens": plain.prompt_tokens},
        "plain": {"tokens": sum(map(len, plain.tokens)), "seconds": plain.seconds, "tokens_per_s": plain.tokens_per_s},
        "rows": [run.row(plain.tokens_per_s) for run in runs],
    }


def write_results(out_dir: str | Path, data: dict) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def summary_table(data: dict) -> str:
    """A fixed-width table of the rows, plain decoding first."""
    head = ("drafter", "k", "accept len", "accept rate", "tokens/step", "tokens/s", "speedup", "match plain")
    lines = [("none (plain)", "0", "1.00", "-", "-", _num(data["plain"]["tokens_per_s"], 1), "1.00", "yes")]
    for row in data["rows"]:
        lines.append((row["drafter"], str(row["k"]), _num(row["mean_acceptance_length"], 2), _num(row["acceptance_rate"], 3),
                      _num(row["tokens_per_step"], 2), _num(row["tokens_per_s"], 1), _num(row["speedup_vs_plain"], 2),
                      _match(row)))
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:<{w}}}" if i < 2 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths)), *(fmt.format(*line) for line in lines)])


def trimming_line(data: dict) -> str:
    """One line saying whether the server's goodput policy could trim the bench's drafts."""
    t = data["trimming"]
    if t["on"]:
        state = ("ON (--allow-trimming): the server's goodput policy verified only the drafts it chose "
                 f"({t['trimmed_drafts']} not verified); the figures count verified drafts")
    elif t["server_trims_drafts"]:
        state = "off: every draft verified (sessions opened with verify_all_drafts; the server trims others' drafts)"
    else:
        state = "off: every draft verified (the server does not trim drafts)"
    return f"draft trimming: {state}"


def _match(row: dict) -> str:
    if row["acceptance"] == REJECTION:  # exact samples of the target, not the plain stream: not a failure
        return "yes (rejection)" if row["streams_match_plain"] else "no (rejection)"
    return "yes" if row["streams_match_plain"] else "NO"


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
