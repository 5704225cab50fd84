"""`python -m verifier check`: the bit-exactness contract (DESIGN.md section 5) proved on a user's
own checkpoint and device, through the engine's public entry points."""

from .checks import CheckSettings, run_checks
from .cli import add_check_parser, check_command

__all__ = ["CheckSettings", "add_check_parser", "check_command", "run_checks"]
