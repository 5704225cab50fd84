"""Choosing a drafter from the command line: the flags every drafter command shares, and the
proposer they name. `generate` and `bench` both call these, so a flag means the same in each.
The design in full: DESIGN.md section 8, "Choosing a drafter".
"""

from __future__ import annotations

import argparse
from pathlib import Path

from verifier.arguments import at_least
from verifier.defaults import default_draft_model_dir
from verifier.params import SamplingParams
from verifier.proposers import NgramProposer, Proposer, RandomProposer

from .messages import ModelInfo

DRAFTERS = ("ngram", "model", "random", "none")  # drafted in this process
SERVER_DRAFTERS = {"mtp": "mtp", "server-ngram": "ngram"}  # the bench's name -> OpenSessionRequest.server_drafter
BENCH_DRAFTERS = DRAFTERS + tuple(SERVER_DRAFTERS)
DEFAULT_K = 4


def drafter_names(text: str) -> list[str]:
    """--drafter ngram,mtp -> ["ngram", "mtp"] (every name one of BENCH_DRAFTERS)."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    bad = [n for n in names if n not in BENCH_DRAFTERS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"--drafter takes {', '.join(BENCH_DRAFTERS)} (comma-separated), got {text!r}")
    return names


def server_drafter(name: str) -> str:
    """The OpenSessionRequest.server_drafter a drafter name stands for; "" for a drafter of this process."""
    return SERVER_DRAFTERS.get(name, "")


def bench_name(wire_name: str) -> str:
    """The drafter name (the bench's) of a server drafter: mtp -> mtp, ngram -> server-ngram."""
    names = {wire: name for name, wire in SERVER_DRAFTERS.items()}
    return names.get(wire_name, f"server-{wire_name}")


def check_server_offers(wire_name: str, info: ModelInfo, flag: str) -> None:
    """Raise ValueError naming `flag` when the served model does not offer the server drafter."""
    if wire_name not in info.server_drafters:
        offered = list(info.server_drafters) if info.server_drafters else "none (a server without server-side drafting)"
        hint = " (mtp needs a checkpoint with an MTP head, served without --no-mtp)" if wire_name == "mtp" else ""
        raise ValueError(f"{flag}: the served model {info.model_id!r} does not offer the server drafter {wire_name!r}{hint}; "
                         f"ModelInfo.server_drafters lists {offered}")


def k_values(text: str) -> list[int]:
    """--k 1,2,4 -> [1, 2, 4] (each >= 0)."""
    parse = at_least(0)
    try:
        values = [parse(part.strip()) for part in text.split(",") if part.strip()]
    except argparse.ArgumentTypeError as err:
        raise argparse.ArgumentTypeError(f"--k: {err}") from None
    if not values:
        raise argparse.ArgumentTypeError("--k is empty")
    return values


def add_drafter_arguments(group, many: bool = False) -> None:
    """Add the drafter flags to a parser or argument group. many=True: --drafter and --k take
    comma-separated lists (the bench sweeps them); else one value each."""
    if many:
        group.add_argument("--drafter", type=drafter_names, default=["ngram"], metavar="NAMES",
                           help=f"comma-separated drafters: {', '.join(DRAFTERS)} (drafted in this process), or "
                                f"{', '.join(SERVER_DRAFTERS)} (drafted by the server for the session: its MTP head, "
                                f"its n-gram proposer; ModelInfo.server_drafters lists what the model offers) "
                                f"(default: ngram)")
        group.add_argument("--k", type=k_values, default=None, metavar="KS",
                           help=f"comma-separated drafts per step, each at most the server's max_k (default: {DEFAULT_K})")
    else:
        group.add_argument("--drafter", default="ngram", choices=DRAFTERS,
                           help="ngram: prompt lookup; model: a small local checkpoint (--draft-model); "
                                "random: K uniform ids (adversarial); none: plain decoding")
        group.add_argument("--k", type=at_least(0), default=None,
                           help=f"drafts per step, at most the server's max_k (default: {DEFAULT_K} with a drafter, "
                                f"or the server's max_k if lower)")
    group.add_argument("--draft-model", type=Path, metavar="DIR",
                       help="checkpoint directory of the model drafter (its vocabulary must equal the served model's; "
                            "default: the shipped draft model, models/draft, made for the shipped target)")
    group.add_argument("--draft-device", default="cpu", help="where the model drafter runs: cpu, cuda or cuda:N")
    group.add_argument("--seed-draft", type=int, default=0, help="seed of the random drafter and of the model drafter's sampling")
    group.add_argument("--ngram-min", type=at_least(1), default=1, help="shortest n-gram the ngram drafter matches")
    group.add_argument("--ngram-max", type=at_least(1), default=3, help="longest n-gram the ngram drafter matches")
    group.add_argument("--coupled-drafts", action="store_true",
                       help="model drafter, sampled sessions: pick each draft with the session's own seeded noise and "
                            "send no probabilities, so the stream equals plain decoding token for token (default: "
                            "sample from the draft model and send its probabilities for exact rejection sampling)")
    group.add_argument("--adaptive-k", action="store_true",
                       help="adapt K per sequence from its recent acceptance, up to --k (drafter/adaptive.py gives the rule)")


def check_drafter_arguments(args, names: list[str]) -> None:
    """Raise ValueError naming the flag for combinations argparse cannot see."""
    if args.ngram_min > args.ngram_max:
        raise ValueError(f"--ngram-min {args.ngram_min} is larger than --ngram-max {args.ngram_max}")
    if "model" in names:
        if args.draft_model is None:
            args.draft_model = default_draft_model_dir()
        if args.draft_model is None:
            raise ValueError("--drafter model needs --draft-model DIR (no default draft model ships in this checkout)")
        if not (Path(args.draft_model) / "config.json").is_file():
            raise ValueError(f"--draft-model: no config.json in {args.draft_model}")
    if args.draft_device != "cpu" and not str(args.draft_device).startswith("cuda"):
        raise ValueError(f"--draft-device must be cpu, cuda or cuda:N, got {args.draft_device!r}")


def make_proposer(name: str, args, info: ModelInfo, sampling: SamplingParams) -> Proposer | None:
    """The proposer `name` stands for, built from the flags (None for "none" and for a server
    drafter, which has no proposer here). `info` is the served model's: the model drafter checks
    its vocabulary against it and sizes its context from it; `sampling` is the session's (the
    model drafter samples its drafts the same way)."""
    if name == "none" or name in SERVER_DRAFTERS:
        return None
    if name == "ngram":
        return NgramProposer(args.ngram_max, args.ngram_min)
    if name == "random":
        return RandomProposer(info.vocab_size, args.seed_draft)
    if name == "model":
        if args.draft_model is None:
            raise ValueError("--drafter model needs --draft-model DIR")
        from verifier.proposers import COUPLED, REJECTION, ModelProposer  # torch only for this drafter

        mode = COUPLED if getattr(args, "coupled_drafts", False) else REJECTION
        return ModelProposer.from_dir(args.draft_model, info.vocab_size, info.max_context, sampling,
                                      device=args.draft_device, seed=args.seed_draft, mode=mode)
    raise ValueError(f"--drafter must be one of {', '.join(BENCH_DRAFTERS)}, got {name!r}")
