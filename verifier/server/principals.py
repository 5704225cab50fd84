"""Who a call comes from: its principal, the owner of the sessions it opens.
The design in full: DESIGN.md section 8, "Principals".
"""

from __future__ import annotations

import hmac
import os
import re
from pathlib import Path

ANONYMOUS = "anonymous"  # every call's principal when no token and no client certificate is configured
DEFAULT = "default"  # the principal of the one --auth-token
TOKENS_ENV = "VERIFIER_AUTH_TOKENS"  # name:token entries, as in an --auth-tokens-file
_NAME = re.compile(r"[A-Za-z0-9._@-]{1,64}")
_TOKEN = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no space (commas are refused apart)


def parse_tokens(text: str, source: str) -> dict[str, str]:
    """`name:token` entries -> {token: name}; ValueError naming the source and the entry's line."""
    tokens: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        for entry in filter(None, (part.strip() for part in line.split(","))):
            name, sep, token = entry.partition(":")
            where = f"{source}, line {number}"
            if not sep:
                raise ValueError(f"{where}: an entry is name:token, got one without ':'")
            if not _NAME.fullmatch(name):
                raise ValueError(f"{where}: principal name {name!r} must be 1 to 64 of A-Z a-z 0-9 . _ @ -")
            if not _TOKEN.fullmatch(token):
                raise ValueError(f"{where}: the token of {name!r} is empty or holds spaces or non-ASCII characters")
            if token in tokens and tokens[token] != name:
                raise ValueError(f"{where}: one token is given to two principals ({tokens[token]!r} and {name!r})")
            tokens[token] = name
    return tokens


def load_tokens(auth_token: str | None, tokens_file: Path | None, environ=os.environ) -> dict[str, str]:
    """Every configured token -> its principal: the one --auth-token (principal "default"), the
    entries of --auth-tokens-file and of VERIFIER_AUTH_TOKENS. Empty: no token auth."""
    tokens: dict[str, str] = {}
    sources = []
    if auth_token:
        sources.append(({auth_token: DEFAULT}, "--auth-token"))
    if tokens_file is not None:
        try:
            text = Path(tokens_file).read_text()
        except OSError as exc:
            raise ValueError(f"--auth-tokens-file {tokens_file}: {exc.strerror or exc}") from None
        parsed = parse_tokens(text, f"--auth-tokens-file {tokens_file}")
        if not parsed:
            raise ValueError(f"--auth-tokens-file {tokens_file} holds no name:token entry")
        sources.append((parsed, f"--auth-tokens-file {tokens_file}"))
    if environ.get(TOKENS_ENV, "").strip():
        sources.append((parse_tokens(environ[TOKENS_ENV], TOKENS_ENV), TOKENS_ENV))
    for parsed, source in sources:
        for token, name in parsed.items():
            if token in tokens and tokens[token] != name:
                raise ValueError(f"{source}: a token of {name!r} is already the token of {tokens[token]!r}")
            tokens[token] = name
    return tokens


class Principals:
    """The call -> principal map of a server (see DESIGN.md section 8, "Principals")."""

    def __init__(self, tokens: dict[str, str], client_certificates: bool = False):
        self._tokens = [(f"Bearer {token}".encode(), name) for token, name in tokens.items()]
        # for handlers: the header auth.py has already matched in constant time, looked up once
        self._by_header = dict(self._tokens)
        self.client_certificates = client_certificates

    @property
    def by_token(self) -> bool:
        return bool(self._tokens)

    @property
    def names(self) -> set[str]:
        return {name for _, name in self._tokens}

    def of_authorization(self, given: bytes) -> str | None:
        """The principal of an authorization header's value, or None. Every token is compared (in
        constant time each), so the time taken says nothing of which one matched."""
        found = None
        for expected, name in self._tokens:
            if hmac.compare_digest(given, expected) and found is None:
                found = name
        return found

    def of(self, context) -> str:
        """The principal of a call a handler serves (auth.py has admitted it)."""
        if self._tokens:
            for key, value in context.invocation_metadata() or ():
                if key == "authorization":
                    name = self._by_header.get(value if isinstance(value, bytes) else value.encode())
                    if name is not None:
                        return name
            raise PermissionError("a call without a known token reached a handler")  # auth.py refuses these first
        if self.client_certificates:
            auth = context.auth_context() or {}
            for key in ("x509_common_name", "x509_subject_alternative_name"):
                values = auth.get(key)
                if values:
                    return (values[0].decode() if isinstance(values[0], bytes) else str(values[0])) or ANONYMOUS
            raise PermissionError("a call without a client certificate reached a handler")  # TLS requires one
        return ANONYMOUS
