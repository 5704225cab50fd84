"""The gRPC verifier server (grpc.aio): sessions, a cross-session batching scheduler in front of
the engine, health, reflection, auth, metrics. `python -m verifier serve` runs it;
`verifier.server.testing.LoopbackServer` runs it inside a test."""

from .app import VerifierServer, serve
from .config import ServerConfig

__all__ = ["ServerConfig", "VerifierServer", "serve"]
