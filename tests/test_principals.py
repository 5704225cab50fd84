"""Principal tokens as configured (verifier/server/principals.py) and the session table's
per-principal accounting (verifier/server/sessions.py), as functions."""

import pytest

from verifier.server.principals import DEFAULT, Principals, load_tokens, parse_tokens
from verifier.server.sessions import FULL, OVER_QUOTA, SessionTable


def test_entries_by_line_and_by_comma():
    assert parse_tokens("# comment\nalice:t1, bob:t2\n\nalice:t3\n", "x") == {"t1": "alice", "t2": "bob", "t3": "alice"}


@pytest.mark.parametrize("text, says", [("alice", "without ':'"), ("al ice:t", "principal name"), (":t", "principal name"),
                                        ("alice:", "empty"), ("alice:t\nbob:t", "two principals"),
                                        ("alice:tok\u00e9n", "non-ASCII")])
def test_bad_entries_name_their_line(text, says):
    with pytest.raises(ValueError, match=says) as refused:
        parse_tokens(text, "--auth-tokens-file f")
    assert "--auth-tokens-file f, line" in str(refused.value)


def test_sources_merge_and_conflicts_are_refused(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("alice:a-token\n")
    tokens = load_tokens("cli-token", path, {"VERIFIER_AUTH_TOKENS": "bob:b-token"})
    assert tokens == {"cli-token": DEFAULT, "a-token": "alice", "b-token": "bob"}
    with pytest.raises(ValueError, match="already the token of 'alice'"):
        load_tokens(None, path, {"VERIFIER_AUTH_TOKENS": "bob:a-token"})
    with pytest.raises(ValueError, match="holds no name:token entry"):
        (tmp_path / "empty").write_text("# nothing\n")
        load_tokens(None, tmp_path / "empty", {})
    with pytest.raises(ValueError, match="--auth-tokens-file .*missing"):
        load_tokens(None, tmp_path / "missing", {})
    assert load_tokens(None, None, {}) == {}


def test_a_token_names_its_principal():
    principals = Principals({"a-token": "alice", "b-token": "bob"})
    assert principals.of_authorization(b"Bearer b-token") == "bob"
    assert principals.of_authorization(b"Bearer a-tokenx") is None and principals.of_authorization(b"a-token") is None


def test_slots_are_counted_per_principal():
    now = [0.0]
    table = SessionTable(3, 4, clock=lambda: now[0], max_per_principal=2)
    assert table.reserve("alice") is None and table.reserve("alice") is None
    assert table.reserve("alice") == OVER_QUOTA
    assert table.reserve("bob") is None
    assert table.reserve("bob") == FULL  # bob is under his share, but every slot is held
    assert table.expected_wait_s() is None
    for t in (1.0, 3.0, 5.0):
        now[0] = t
        table.unreserve("alice" if t < 4 else "bob")
        table.reserve("carol" if t > 4 else "dave")
    assert table.expected_wait_s() == 2.0  # releases 2 s apart
    assert table.held == {"dave": 2, "carol": 1}
