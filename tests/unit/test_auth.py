"""Token files, roles, the data-port proof, safe binding and credentials (no servers)."""

from __future__ import annotations

import logging

import pytest

from kvstore.auth import (AuthFileError, Role, TokenFile, allows, client_token, new_nonce,
                          parse_tokens, proof)
from kvstore.binding import BindRefused, advertised_host, check_binding, is_loopback
from kvstore.rpc import ClientCredentials, ServerSecurity, bearer

ADMIN = "a" * 32
CLIENT = "c" * 32
NODE = "n" * 32


def _file(tmp_path, text: str) -> str:
    path = tmp_path / "tokens"
    path.write_text(text)
    return str(path)


def test_parse_roles_comments_and_blank_lines():
    table = parse_tokens(f"# role token\n\nadmin {ADMIN}\nCLIENT {CLIENT}  # engines\nnode {NODE}\n")
    assert table == {ADMIN: Role.ADMIN, CLIENT: Role.CLIENT, NODE: Role.NODE}


@pytest.mark.parametrize("text, message", [
    ("admin", "expected 'ROLE TOKEN'"),
    (f"root {ADMIN}", "unknown role"),
    ("admin short", "16 characters"),
    (f"admin {ADMIN}\nclient {ADMIN}", "listed twice"),
    ("# nothing\n", "no tokens"),
])
def test_bad_token_files_say_why(text, message):
    with pytest.raises(AuthFileError, match=message):
        parse_tokens(text, "f")


def test_role_of_and_allows(tmp_path):
    tokens = TokenFile(_file(tmp_path, f"admin {ADMIN}\nclient {CLIENT}\nnode {NODE}\n"))
    assert tokens.role_of(CLIENT) is Role.CLIENT
    assert tokens.role_of(CLIENT[:-1]) is None
    assert tokens.role_of("") is None and tokens.role_of(None) is None
    assert allows(Role.ADMIN, frozenset())
    assert allows(Role.NODE, frozenset({Role.NODE}))
    assert not allows(Role.CLIENT, frozenset({Role.NODE}))


def test_reload_picks_up_a_changed_file_and_keeps_the_old_on_error(tmp_path, caplog):
    path = _file(tmp_path, f"client {CLIENT}\n")
    tokens = TokenFile(path)
    assert tokens.role_of(ADMIN) is None
    (tmp_path / "tokens").write_text(f"admin {ADMIN}\n")
    assert tokens.reload()
    assert tokens.role_of(ADMIN) is Role.ADMIN and tokens.role_of(CLIENT) is None
    (tmp_path / "tokens").write_text("garbage\n")
    with caplog.at_level(logging.ERROR):
        assert not tokens.reload()
    assert tokens.role_of(ADMIN) is Role.ADMIN
    assert ADMIN not in caplog.text            # tokens are never logged


def test_proof_binds_token_and_nonce(tmp_path):
    tokens = TokenFile(_file(tmp_path, f"client {CLIENT}\nnode {NODE}\n"))
    nonce = new_nonce()
    assert len(nonce) == 32 and nonce != new_nonce()
    assert tokens.role_of_proof(nonce, proof(NODE, nonce)) is Role.NODE
    assert tokens.role_of_proof(new_nonce(), proof(NODE, nonce)) is None   # replayed
    assert tokens.role_of_proof(nonce, proof(ADMIN, nonce)) is None        # unknown token
    assert NODE.encode() not in proof(NODE, nonce)


def test_client_token_sources(tmp_path, monkeypatch):
    monkeypatch.delenv("KVSTORE_TOKEN", raising=False)
    monkeypatch.delenv("KVSTORE_TOKEN_FILE", raising=False)
    assert client_token() is None
    path = _file(tmp_path, f"# mine\nclient {CLIENT}\n")
    monkeypatch.setenv("KVSTORE_TOKEN_FILE", path)
    assert client_token() == CLIENT
    monkeypatch.setenv("KVSTORE_TOKEN", ADMIN)
    assert client_token() == ADMIN
    assert client_token(token_file=path) == CLIENT
    assert client_token("explicit-token-000") == "explicit-token-000"


def test_a_client_token_file_that_is_not_text_is_an_os_error(tmp_path):
    path = tmp_path / "bin.tok"
    path.write_bytes(b"\xe5\x00\xff" * 20)
    with pytest.raises(OSError, match="not UTF-8"):       # what every command reports
        client_token(token_file=str(path))


def test_credentials_never_print_the_token():
    creds = ClientCredentials(token=ADMIN)
    assert ADMIN not in repr(creds) and ADMIN not in str(creds)


def test_bearer_and_server_security(tmp_path):
    assert bearer([("authorization", f"Bearer {CLIENT}")]) == CLIENT
    assert bearer([("authorization", CLIENT)]) is None
    assert bearer(None) is None
    open_server = ServerSecurity()
    assert open_server.role_of(None) is Role.ADMIN        # no --auth: loopback, trusted
    secured = ServerSecurity(tokens=TokenFile(_file(tmp_path, f"client {CLIENT}\n")))
    assert secured.role_of(None) is None
    assert secured.role_of([("authorization", f"Bearer {CLIENT}")]) is Role.CLIENT


def test_binding_rules(caplog):
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("198.18.0.1")
    check_binding("master", "127.0.0.1", authenticated=False, insecure=False)
    check_binding("master", "0.0.0.0", authenticated=True, insecure=False)
    with pytest.raises(BindRefused, match="without --auth"):
        check_binding("master", "0.0.0.0", authenticated=False, insecure=False)
    with caplog.at_level(logging.WARNING):
        check_binding("master", "0.0.0.0", authenticated=False, insecure=True)
    assert "WITHOUT authentication" in caplog.text


def test_advertised_host_is_never_the_wildcard():
    assert advertised_host("0.0.0.0", "10.1.2.3") == "10.1.2.3"
    assert advertised_host("127.0.0.1") == "127.0.0.1"
    assert advertised_host("0.0.0.0", toward="127.0.0.1:5000") == "127.0.0.1"
    assert advertised_host("0.0.0.0") not in ("0.0.0.0", "", "::")
