"""Tenants: the tenant of a key, token scopes and quotas in the --auth file."""

from __future__ import annotations

import pytest

from kvstore.auth import AuthFileError, Role, TokenFile, parse_auth, proof
from kvstore.keys import Namespace, prefix_keys
from kvstore.tenants import (ALL, DEFAULT_ONLY, DEFAULT_TENANT, Quota, Scope, parse_size,
                             tenant_key, tenant_of)

A, B, ZERO, ADMIN, NODE, MET = ("a" * 32, "b" * 32, "0" * 32, "x" * 32, "n" * 32, "m" * 32)


@pytest.mark.parametrize("key, tenant", [
    ("@acme/3f2a", "acme"), ("@a.b-c_9/x/y", "a.b-c_9"), ("3f2a", DEFAULT_TENANT),
    ("w-1", DEFAULT_TENANT), ("@acme", DEFAULT_TENANT), ("@/x", DEFAULT_TENANT),
    ("@bad name/x", DEFAULT_TENANT), ("x@acme/y", DEFAULT_TENANT), ("@" + "t" * 65 + "/x", DEFAULT_TENANT),
])
def test_the_tenant_of_a_key(key, tenant):
    assert tenant_of(key) == tenant


def test_tenant_keys_round_trip_and_default_has_no_prefix():
    assert tenant_key("acme", "k") == "@acme/k" and tenant_of(tenant_key("acme", "k")) == "acme"
    assert tenant_key(DEFAULT_TENANT, "k") == "k"
    with pytest.raises(ValueError, match="bad tenant name"):
        tenant_key("a/b", "k")


def test_prefix_keys_of_a_tenant_namespace_are_that_tenants():
    tokens = list(range(32))
    plain = prefix_keys(tokens, Namespace("m", block_tokens=16))
    mine = prefix_keys(tokens, Namespace("m", block_tokens=16, tenant="acme"))
    assert all(tenant_of(k) == DEFAULT_TENANT for k in plain)
    assert all(k.startswith("@acme/") and tenant_of(k) == "acme" for k in mine)
    assert {k[len("@acme/"):] for k in mine}.isdisjoint(plain)      # the tenant is hashed too


def test_sizes():
    assert parse_size("4096") == 4096 and parse_size("100MiB") == 100 << 20
    assert parse_size("1.5GiB") == 3 << 29 and parse_size("10GB") == 10 ** 10
    with pytest.raises(ValueError):
        parse_size("lots")


def test_auth_file_scopes_and_quotas():
    auth = parse_auth(f"client {A} tenants=acme\nclient {B} tenants=acme,beta\nclient {ZERO}\n"
                      f"admin {ADMIN}\nnode {NODE}\nmetrics {MET} tenants=beta\n"
                      "tenant beta bytes=100MiB objects=1000 share=20%\ntenant acme share=1GiB\n")
    assert auth.roles[A] is Role.CLIENT
    assert auth.scope_of_token(A) == Scope(frozenset({"acme"}))
    assert auth.scope_of_token(B).allows("@beta/k") and not auth.scope_of_token(A).allows("@beta/k")
    assert auth.scope_of_token(ZERO) == DEFAULT_ONLY and DEFAULT_ONLY.allows("plain")
    assert auth.scope_of_token(ADMIN) is ALL and auth.scope_of_token(NODE) is ALL
    assert auth.quotas["beta"] == Quota(max_bytes=100 << 20, max_objects=1000, share_fraction=0.2)
    assert auth.quotas["acme"].share_of(10 << 30) == 1 << 30
    assert auth.quotas["beta"].share_of(10 << 30) == 2 << 30


@pytest.mark.parametrize("text, message", [
    (f"admin {ADMIN} tenants=acme", "tenants= is for client and metrics"),
    (f"client {A} tenants=", "expected 'tenants=NAME"),
    (f"client {A} tenants=a/b", "bad tenant name"),
    (f"client {A}\ntenant acme bytes=lots", "bad size"),
    (f"client {A}\ntenant acme color=red", "unknown field"),
    (f"client {A}\ntenant acme\ntenant acme", "listed twice"),
    (f"client {A}\ntenant acme share=150%", "within 0-100%"),
    (f"client {A}\ntenant acme bytes=1KiB bytes=2KiB", "repeated field"),
    (f"client {A}\ntenant acme share=10% share=1GiB", "repeated field"),
    (f"client {A}\ntenant acme objects=\u0663", "not a count"),
    (f"client {A}\ntenant acme objects=+5", "not a count"),
    (f"client {A}\ntenant acme objects=1_000", "not a count"),
    (f"client {A}\ntenant acme bytes=\u0663MiB", "bad size"),
    (f"client {A}\ntenant acme share=nan%", "within 0-100%"),
])
def test_bad_tenant_lines_say_why(text, message):
    with pytest.raises(AuthFileError, match=message):
        parse_auth(text, "f")


def test_token_file_credentials_reload_and_listeners(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"client {A} tenants=acme\nadmin {ADMIN}\n")
    tokens = TokenFile(str(path))
    seen = []
    tokens.on_reload.append(seen.append)
    assert tokens.credentials_of(A) == (Role.CLIENT, Scope(frozenset({"acme"})))
    role, _fp, scope = tokens.proof_credentials(b"n" * 32, proof(A, b"n" * 32))
    assert role is Role.CLIENT and scope.allows("@acme/k") and not scope.allows("k")
    path.write_text(f"client {A} tenants=beta\nadmin {ADMIN}\ntenant beta objects=5\n")
    assert tokens.reload()
    assert tokens.credentials_of(A)[1].allows("@beta/k") and tokens.quotas["beta"].max_objects == 5
    assert len(seen) == 1 and seen[0].quotas["beta"].max_objects == 5
    path.write_text("garbage\n")
    assert not tokens.reload() and tokens.credentials_of(A)[1].allows("@beta/k")
