"""`python -m verifier serve`: its flags, derived from ServerConfig's fields (one flag per field,
the field's default and help), and the command itself.

    add_serve_parser(subparsers)   # in the program's parser
    serve_command(args) -> int     # 0 after a clean shutdown, 2 on bad options or a port in use
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from pathlib import Path

from .config import ServerConfig



def _int_list(text: str) -> tuple[int, ...]:
    """"1,2,4" -> (1, 2, 4)."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


_PARSERS = {int: int, float: float, str: str, Path: Path, tuple[int, ...]: _int_list}


def flag_name(spec: dataclasses.Field) -> str:
    return spec.metadata.get("flag", "--" + spec.name.replace("_", "-"))


def _value_type(spec: dataclasses.Field, hints: dict) -> type:
    """The field's type without its `| None`."""
    if hints[spec.name] in _PARSERS:
        return _PARSERS[hints[spec.name]]
    kinds = [t for t in typing.get_args(hints[spec.name]) if t is not type(None)] or [hints[spec.name]]
    (kind,) = kinds
    return _PARSERS[kind]


def shown_default(value) -> str:
    """A default as its flag would spell it (a tuple as comma-separated values)."""
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def _help(spec: dataclasses.Field) -> str:
    if spec.default is not dataclasses.MISSING:
        return f"{spec.metadata['help']} (default: {shown_default(spec.default)})"
    if "fallback" in spec.metadata:
        return f"{spec.metadata['help']} (default: {spec.metadata['fallback']})"
    return f"{spec.metadata['help']} (required)"


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """The `serve` subcommand: one flag per ServerConfig field, plus -v."""
    parser = subparsers.add_parser("serve", help="serve the verifier over gRPC until SIGTERM / SIGINT",
                                   description="Serve the verifier over gRPC until SIGTERM / SIGINT.")
    hints = typing.get_type_hints(ServerConfig)
    for spec in dataclasses.fields(ServerConfig):
        has_default = spec.default is not dataclasses.MISSING
        if hints[spec.name] is bool:  # --name / --no-name
            action = parser.add_argument(flag_name(spec), dest=spec.name, action=argparse.BooleanOptionalAction,
                                         default=spec.default)
            action.help = _help(spec)  # argparse may append its own "(default: ...)"; keep one
            continue
        parser.add_argument(flag_name(spec), dest=spec.name, type=_value_type(spec, hints),
                            choices=spec.metadata.get("choices"), help=_help(spec),
                            default=spec.default if has_default else None,
                            required=not has_default and "fallback" not in spec.metadata)
    parser.add_argument("-v", "--verbose", action="store_true", help="log INFO lines (default: off)")
    return parser


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The parsed `serve` flags -> ServerConfig (ValueError names a bad option)."""
    values = {spec.name: getattr(args, spec.name) for spec in dataclasses.fields(ServerConfig)}
    if values["model_dir"] is None:
        from ..defaults import default_model_dir

        values["model_dir"] = default_model_dir()
    return ServerConfig(**values)


def serve_command(args: argparse.Namespace) -> int:
    """Serve until SIGTERM / SIGINT. Bad options, an unreadable checkpoint and a port in use print
    one line and return 2."""
    import torch

    from .app import serve

    if args.device == "cuda" and not torch.cuda.is_available():
        return _fail("--device cuda, but torch sees no CUDA device")
    if args.device == "cuda" and torch.cuda.device_count() < args.tensor_parallel:
        return _fail(f"--tensor-parallel {args.tensor_parallel} with --device cuda needs {args.tensor_parallel} GPUs; "
                     f"torch sees {torch.cuda.device_count()}")
    try:
        config = config_from_args(args)
        if config.auth_token:
            print("warning: --auth-token shows in the process list to every local user; put name:token lines in "
                  "--auth-tokens-file or $VERIFIER_AUTH_TOKENS instead", file=sys.stderr)
        if config.tensor_parallel > 1:
            from .parallel import serve_tensor_parallel

            return serve_tensor_parallel(config)
        return serve(config)
    except (ValueError, OSError) as exc:
        return _fail(str(exc))


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2
