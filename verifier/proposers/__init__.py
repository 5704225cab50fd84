"""Proposers (drafters): given the sequence so far, propose up to K next tokens.

The one home of the proposer protocol and of the drafters both front ends use: the in-process
loop (`python -m verifier generate --draft ...`) and the drafter process (`python -m drafter`),
which imports them from here (verifier never imports drafter).

Importing this package does not import torch: n-gram, random and oracle drafting need none. The
model drafter (ModelProposer, load_draft_model, its modes REJECTION and COUPLED) runs a checkpoint
through the engine, so it is loaded on first use of one of those names; so is MTPProposer (the
checkpoint's MTP head drafting from the target's hidden rows).
"""

from __future__ import annotations

import importlib

from .ngram import NgramProposer
from .protocol import HiddenStateProposer, ProbabilityProposer, Proposer
from .regression import OracleProposer, RandomProposer

_MODEL_DRAFTER = ("ModelProposer", "load_draft_model", "REJECTION", "COUPLED")

__all__ = ["Proposer", "ProbabilityProposer", "HiddenStateProposer", "MTPProposer", "NgramProposer", "RandomProposer", "OracleProposer", *_MODEL_DRAFTER]


def __getattr__(name: str):
    if name in _MODEL_DRAFTER:
        return getattr(importlib.import_module(".model", __name__), name)
    if name == "MTPProposer":  # runs the checkpoint's MTP head: torch, loaded on first use as the model drafter
        return importlib.import_module(".mtp", __name__).MTPProposer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
