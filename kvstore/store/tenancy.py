"""Which tenants one data connection may touch (:mod:`kvstore.tenants`).

A read-side op (GET, SHM_ACQUIRE, PIN, UNPIN, PREFETCH) of another tenant's
key answers as for a key the node does not hold (NOT_FOUND "not on this
node"); a write (PUT, SHM_ALLOC, SHM_COMMIT) is refused (PERMISSION_DENIED,
whether the key exists or not: nothing is confirmed); DROP and SHM_TOUCH of
it answer OK and do nothing, as for a key not held. The shared-memory
segment itself is not split by tenant (see docs/tenants.md).

The data port's handshake proves a token; the token's scope in the node's
``--auth`` file decides which keys the connection's frames may name. A
SIGHUP reload of the file replaces its table: a connection notices at its
next op (the table it read from is not the file's any more) and reads its
token's scope again, by the token's fingerprint (the session never keeps
the token). A token the new file no longer holds may touch no key.

Thread safety: one :class:`ConnectionScope` per connection thread; the
fingerprint table shared by every connection is built under a lock.
"""

from __future__ import annotations

import threading

from kvstore.auth import AuthTable, TokenFile, fingerprint
from kvstore.errors import NotFound, PermissionDenied
from kvstore.tenants import ALL, Scope, tenant_of

#: The scope of a connection not authenticated yet, or whose token a reload removed.
NO_TENANT = Scope(frozenset())
_lock = threading.Lock()
_by_fingerprint: tuple[AuthTable | None, dict[str, Scope]] = (None, {})


def scope_of_fingerprint(table: AuthTable, fp: str) -> Scope:
    """The scope ``table`` gives the token of :func:`~kvstore.auth.fingerprint` ``fp``
    (no tenant when it holds no such token). One table's fingerprints are computed
    once, for every connection."""
    global _by_fingerprint
    with _lock:
        known, scopes = _by_fingerprint
        if known is not table:
            scopes = {fingerprint(t): table.scope_of_token(t) for t in table.roles}
            _by_fingerprint = (table, scopes)
    return scopes.get(fp, NO_TENANT)


class ConnectionScope:
    """One connection's tenants: every key without ``--auth`` (``tokens`` None),
    none until :meth:`proved`, then its token's, following reloads."""

    __slots__ = ("tokens", "scope", "fingerprint", "_table")

    def __init__(self, tokens: TokenFile | None):
        self.tokens = tokens
        self.scope: Scope = ALL if tokens is None else NO_TENANT
        self.fingerprint = ""
        self._table: AuthTable | None = None

    def proved(self, fp: str, scope: Scope) -> None:
        """The handshake matched the token of fingerprint ``fp``, of ``scope``."""
        self.fingerprint, self.scope = fp, scope
        self._table = None               # read again from the file's table at the first op

    def allows(self, key: str) -> bool:
        """Whether the connection may touch ``key`` (always without --auth)."""
        tokens = self.tokens
        if tokens is None:
            return True
        table = tokens.table
        if table is not self._table:     # the first op, or the file was reloaded
            self._table = table
            self.scope = scope_of_fingerprint(table, self.fingerprint)
        return self.scope.allows(key)

    def check_read(self, key: str) -> None:
        """Raises NotFound, as for a key the node does not hold, for another tenant's key."""
        if not self.allows(key):
            raise NotFound("not on this node", key=key)

    def check_write(self, key: str, undo=None) -> None:
        """Raises PermissionDenied for another tenant's key (by its name alone), after
        calling ``undo`` (a reservation given back) when given."""
        if not self.allows(key):
            if undo is not None:
                undo()
            raise PermissionDenied(f"this connection's token may not write tenant "
                                   f"{tenant_of(key)!r}'s keys", key=key)
