"""Drafter side: the client library, proposers and the generation loop (issue 5 builds it)."""
