"""Arguments both command lines share (`python -m verifier`, `python -m drafter`): argument types,
the sampling flags and the help formatter that shows every flag's default.

No torch here: the drafter imports it.
"""

from __future__ import annotations

import argparse

from .params import SamplingParams

# flag -> SamplingParams field; each field is validated by SamplingParams itself
SAMPLING_FLAGS = {"--temperature": "temperature", "--top-k": "top_k", "--top-p": "top_p", "--seed": "seed"}


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends "(default: ...)" to a flag's help unless the help already states its default: a
    switch says "(default: off)"; a required flag, or one whose default is None, must say in words
    what happens without it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.required or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if action.nargs == 0:  # store_true and friends
            return f"{text} (default: off)"
        if action.default is None:
            return text
        return f"{text} (default: %(default)s)"


class OneLineErrors(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr, naming the command and the flag, and
    exit status 2 (argparse's own prints the whole usage first). Subcommands' parsers are of the
    same class (add_subparsers makes its parsers so)."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def token_ids(text: str) -> list[int]:
    """--prompt-ids 1,2,3 -> [1, 2, 3]."""
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty")
    return ids


def utf8_text(text: str) -> str:
    """--text as given, refused when the shell passed bytes that are not UTF-8: Python keeps each
    such byte as a lone surrogate, which neither a tokenizer nor a protobuf string can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        byte = ord(exc.object[exc.start]) - 0xDC00 if 0xDC80 <= ord(exc.object[exc.start]) <= 0xDCFF else None
        where = f"byte 0x{byte:02x} at character {exc.start}" if byte is not None else f"character {exc.start}"
        raise argparse.ArgumentTypeError(f"is not valid UTF-8 ({where})") from None
    if not text:
        raise argparse.ArgumentTypeError("is empty: give the prompt text, or --prompt-ids")
    return text


def at_least(low: int, most: int | None = None, why: str = ""):
    """An integer argument type that refuses values below `low` (and above `most`, saying `why`)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"must be at most {most}, got {value}{': ' + why if why else ''}")
        return value

    return parse


def add_sampling_arguments(parser) -> None:
    """The sampling flags (a parser or an argument group); defaults are SamplingParams' (greedy)."""
    defaults = SamplingParams()
    group = parser.add_argument_group("sampling (greedy unless --temperature > 0)")
    group.add_argument("--temperature", type=float, default=defaults.temperature,
                       help="0: greedy (argmax); > 0: coupled sampling, the token at each position drawn with noise "
                            "keyed by (--seed, position), so a speculative run samples exactly the plain run's tokens")
    group.add_argument("--top-k", type=at_least(0), default=defaults.top_k,
                       help="sample among the k most likely ids only (0: off)")
    group.add_argument("--top-p", type=float, default=defaults.top_p,
                       help="sample among the most likely ids whose mass reaches p (1: off)")
    group.add_argument("--seed", type=at_least(0), default=defaults.seed, help="seed of the sampling noise (0 .. 2^64-1)")


def sampling_from_args(args) -> SamplingParams:
    """The SamplingParams the sampling flags describe; ValueError naming the flag when one is out of
    range (the command exits 2 with it)."""
    for flag, name in SAMPLING_FLAGS.items():
        try:
            SamplingParams(**{name: getattr(args, name)})  # each field's check alone: the error names its flag
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}") from None
    return SamplingParams(**{name: getattr(args, name) for name in SAMPLING_FLAGS.values()})


def flags_without_stated_default(parser: argparse.ArgumentParser) -> list[str]:
    """The flags of `parser` whose help, as printed, states no default (required flags, those of a
    required one-of group, and --help excepted): the tests of both command lines hold this list empty."""
    formatter = parser.formatter_class(parser.prog)
    # argparse offers no public walk over a parser's flags
    required = {id(a) for group in parser._mutually_exclusive_groups if group.required for a in group._group_actions}
    missing = []
    for action in parser._actions:
        if not action.option_strings or action.required or id(action) in required or isinstance(action, argparse._HelpAction):
            continue
        if not action.help or "default" not in formatter._expand_help(action):
            missing.append("/".join(action.option_strings))
    return missing
