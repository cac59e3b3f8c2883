"""Identities and roles: the ``--auth`` token file, and the proofs clients present.

A server started with ``--auth FILE`` authenticates every connection or call.
The file holds one ``ROLE TOKEN`` per line (``#`` starts a comment)::

    # role    token
    admin     6f1d...         everything: remove, evict, list, inspect, stats
    client    9a3c...         what engines and the SDK need: put, get, exists,
                              lookup, pin, prefetch, remove of its own keys
    node      c0de...         register, heartbeat, report events, repair copies
    metrics   5ca1...         read /metrics (a Prometheus scraper; kvstore.metrics)

A ``client`` or ``metrics`` line may bind its token to tenants (``tenants=a,b``;
without it: the ``default`` tenant only), and ``tenant`` lines set quotas; see
:mod:`kvstore.tenants`. Admin and node tokens see every tenant.

A role grants what it names and admin grants everything. Clients present a
token (``KVClient(token=...)``, ``$KVSTORE_TOKEN`` or ``--token-file``):

    gRPC        metadata ``authorization: Bearer TOKEN``, checked in one interceptor
                (:mod:`kvstore.rpc`); UNAUTHENTICATED / PERMISSION_DENIED
    data port   challenge-response at connection start: the node sends a random
                nonce, the client answers HMAC-SHA256(token, nonce) (:func:`proof`);
                the token never crosses the link, TLS or not
    HTTP        ``Authorization: Bearer TOKEN``; 401 / 403

Tokens are compared in constant time (every token is compared, found or
not) and never logged; the file is read again on SIGHUP (:meth:`TokenFile.reload`).

Thread safety: a TokenFile's table is replaced whole on reload (one
assignment), so lookups from any thread see the old or the new table.
"""

from __future__ import annotations

import enum
import errno
import hashlib
import hmac
import logging
import os
import secrets
from dataclasses import dataclass, field
from typing import Callable, Sequence

from kvstore import tenants as tn

log = logging.getLogger(__name__)

#: Environment variables a client reads its credentials from.
TOKEN_ENV = "KVSTORE_TOKEN"
TOKEN_FILE_ENV = "KVSTORE_TOKEN_FILE"

NONCE_BYTES = 32
_PROOF_DOMAIN = b"kvstore-data-port-auth-v1"
_MAX_TOKENS = 10_000
_MIN_TOKEN_CHARS = 16


class Role(str, enum.Enum):
    """Who a caller is. Admin may do everything; the others what they name."""

    ADMIN = "admin"
    CLIENT = "client"
    NODE = "node"
    METRICS = "metrics"        # reads /metrics only (a Prometheus scraper)


class AuthFileError(ValueError):
    """The token file cannot be used (a bad line, an unknown role, a short token)."""


@dataclass(frozen=True)
class AuthTable:
    """What an ``--auth`` file says: each token's role and tenants, each tenant's quota."""

    roles: dict[str, Role]
    scopes: dict[str, tn.Scope] = field(default_factory=dict)
    quotas: dict[str, tn.Quota] = field(default_factory=dict)

    def scope_of_token(self, token: str) -> tn.Scope:
        return self.scopes.get(token, tn.ALL)


def parse_auth(text: str, source: str = "<tokens>") -> AuthTable:
    """An :class:`AuthTable` from the text of a token file: ``ROLE TOKEN
    [tenants=NAME,...]`` and ``tenant NAME [bytes=SIZE] [objects=N] [share=SIZE|PCT%]``
    lines (:mod:`kvstore.tenants`).

    Raises:
        AuthFileError: a line that is neither, an unknown role, a token under 16
            characters, a token listed twice, ``tenants=`` on an admin or node token,
            a bad tenant line or a tenant quoted twice, or no token at all.
    """
    table: dict[str, Role] = {}
    scopes: dict[str, tn.Scope] = {}
    quotas: dict[str, tn.Quota] = {}
    for where, parts in tn.config_lines(text, source):
        if parts[0].lower() == "tenant":
            try:
                tn.add_quota(quotas, parts[1:], where)
            except ValueError as exc:
                raise AuthFileError(str(exc)) from None
            continue
        if len(parts) not in (2, 3):
            raise AuthFileError(f"{where}: expected 'ROLE TOKEN' or 'ROLE TOKEN tenants=NAME,...'")
        role_name, token = parts[:2]
        try:
            role = Role(role_name.lower())
        except ValueError:
            raise AuthFileError(f"{where}: unknown role {role_name!r}; known: "
                                f"{[r.value for r in Role]}") from None
        if len(token) < _MIN_TOKEN_CHARS:
            raise AuthFileError(f"{where}: a token needs {_MIN_TOKEN_CHARS} characters or more")
        if token in table:
            raise AuthFileError(f"{where}: a token is listed twice")
        table[token] = role
        if role in (Role.CLIENT, Role.METRICS):
            try:
                scopes[token] = tn.parse_scope(parts[2], where) if len(parts) == 3 \
                    else tn.DEFAULT_ONLY
            except ValueError as exc:
                raise AuthFileError(str(exc)) from None
        elif len(parts) == 3:
            raise AuthFileError(f"{where}: a {role.value} token sees every tenant; "
                                f"tenants= is for client and metrics tokens")
        if len(table) > _MAX_TOKENS:
            raise AuthFileError(f"{source}: more than {_MAX_TOKENS} tokens")
    if not table:
        raise AuthFileError(f"{source}: no tokens")
    return AuthTable(table, scopes, quotas)


def parse_tokens(text: str, source: str = "<tokens>") -> dict[str, Role]:
    """Token -> role from the text of a token file (:func:`parse_auth`'s roles).

    Raises:
        AuthFileError: as :func:`parse_auth`.
    """
    return parse_auth(text, source).roles


def proof(token: str, nonce: bytes) -> bytes:
    """What a data-port client answers to the node's ``nonce``: HMAC-SHA256 (32 bytes)."""
    return hmac.new(token.encode(), _PROOF_DOMAIN + nonce, hashlib.sha256).digest()


def fingerprint(token: str | None) -> str:
    """A short, non-reversible name of a token (which credentials a node registered with)."""
    if not token:
        return ""
    return hashlib.sha256(_PROOF_DOMAIN + token.encode()).hexdigest()[:16]


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def allows(role: Role, allowed: frozenset[Role]) -> bool:
    """Whether ``role`` may do what ``allowed`` roles may (admin may do everything)."""
    return role is Role.ADMIN or role in allowed


class TokenFile:
    """The roles a server knows, from its ``--auth`` file.

    Args:
        path: the file (``ROLE TOKEN`` lines).

    Raises:
        AuthFileError: the file is malformed (see :func:`parse_tokens`).
        OSError: it cannot be read.
    """

    def __init__(self, path: str):
        self.path = path
        self._auth = self._read()
        #: Called with the new :class:`AuthTable` after each successful reload.
        self.on_reload: list[Callable[[AuthTable], None]] = []

    def _read(self) -> AuthTable:
        with open(self.path, encoding="utf-8") as f:
            return parse_auth(f.read(), self.path)

    @property
    def table(self) -> AuthTable:
        return self._auth

    @property
    def quotas(self) -> dict[str, tn.Quota]:
        return self._auth.quotas

    def reload(self) -> bool:
        """Read the file again (SIGHUP); a bad file keeps the old table. Returns success."""
        try:
            self._auth = self._read()
        except (OSError, AuthFileError) as exc:
            log.error("token file %s not reloaded, keeping the old one: %s", self.path, exc)
            return False
        log.info("token file %s reloaded: %d token(s), %d tenant quota(s)", self.path,
                 len(self._auth.roles), len(self._auth.quotas))
        for hook in list(self.on_reload):
            try:
                hook(self._auth)
            except Exception:                  # noqa: BLE001 - one listener must not stop the rest
                log.exception("token file %s: a reload listener failed", self.path)
        return True

    def _find(self, given: bytes) -> str | None:
        found: str | None = None
        for known in self._auth.roles:
            if hmac.compare_digest(known.encode(), given):
                found = known
        return found

    def role_of(self, token: str | None) -> Role | None:
        """The role of ``token``, or None; compares with every token, in constant time."""
        creds = self.credentials_of(token)
        return creds[0] if creds else None

    def credentials_of(self, token: str | None) -> tuple[Role, tn.Scope] | None:
        """The role and tenants of ``token``, or None; constant time as :meth:`role_of`."""
        if not token:
            return None
        auth = self._auth
        known = self._find(token.encode())
        return (auth.roles[known], auth.scope_of_token(known)) if known is not None else None

    def role_of_proof(self, nonce: bytes, answer: bytes) -> Role | None:
        """The role whose token made ``answer`` to ``nonce`` (the data-port handshake), or None."""
        found = self.match_proof(nonce, answer)
        return found[0] if found else None

    def match_proof(self, nonce: bytes, answer: bytes) -> tuple[Role, str] | None:
        """The role and :func:`fingerprint` of the token that made ``answer`` to
        ``nonce``, or None; compares with every token, in constant time."""
        found = self.proof_credentials(nonce, answer)
        return (found[0], found[1]) if found else None

    def proof_credentials(self, nonce: bytes, answer: bytes) -> tuple[Role, str, tn.Scope] | None:
        """The role, :func:`fingerprint` and tenants of the token that made ``answer``
        to ``nonce``, or None; compares with every token, in constant time."""
        found = self.proof_token(nonce, answer)
        if found is None:
            return None
        auth = self._auth
        return auth.roles[found], fingerprint(found), auth.scope_of_token(found)

    def proof_token(self, nonce: bytes, answer: bytes) -> str | None:
        """The token that made ``answer`` to ``nonce``, or None (a server keeps it to
        read the token's role and tenants from the table of each call's time);
        compares with every token, in constant time."""
        found: str | None = None
        for known in self._auth.roles:
            if hmac.compare_digest(proof(known, nonce), answer):
                found = known
        return found


def bearer(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """The token of an ``authorization: Bearer TOKEN`` entry, or None."""
    for k, v in metadata or ():
        if k == "authorization":
            value = v.decode() if isinstance(v, bytes) else v
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():    # the scheme is case-blind
                return token.strip()
    return None


def client_token(token: str | None = None, token_file: str | None = None) -> str | None:
    """A client's token: ``token``, else ``token_file``'s first line, else
    ``$KVSTORE_TOKEN``, else the file named by ``$KVSTORE_TOKEN_FILE``; None: anonymous.

    Raises:
        OSError: a token file that cannot be read.
    """
    if token:
        return token
    path = token_file or os.environ.get(TOKEN_FILE_ENV)
    if token_file:
        return _read_token(token_file)
    env = os.environ.get(TOKEN_ENV)
    if env:
        return env.strip()
    return _read_token(path) if path else None


def _read_token(path: str) -> str | None:
    """The token of a token file (OSError also when it is not UTF-8 text)."""
    try:
        with open(path, encoding="utf-8") as f:
            for raw in f:
                line = raw.split("#", 1)[0].strip()
                if line:
                    return line.split()[-1]      # "TOKEN" or "ROLE TOKEN"
    except UnicodeDecodeError as exc:
        raise OSError(errno.EILSEQ, f"not UTF-8 text (byte {exc.start})", path) from None
    return None
