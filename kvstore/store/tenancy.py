"""Which tenants one data connection may touch (:mod:`kvstore.tenants`).

A read-side op (GET, SHM_ACQUIRE, PIN, UNPIN, PREFETCH) of another tenant's
key answers as for a key the node does not hold (NOT_FOUND "not on this
node"); a write (PUT, SHM_ALLOC, SHM_COMMIT) is refused (PERMISSION_DENIED,
whether the key exists or not: nothing is confirmed); DROP and SHM_TOUCH of
it answer OK and do nothing, as for a key not held. The shared-memory
segment itself is not split by tenant (see docs/tenants.md).

The data port's handshake proves a token; the token's role decides which
ops the connection may use, its scope in the node's ``--auth`` file which
keys its frames may name:

    client, admin, node   the object ops (their keys checked by the scope)
    metrics               none: every object op is PermissionDenied (a role
                          check, the same for every key); PING only
    STATS                 admin and node only (the node's store-wide figures:
                          ALL scope); every other token PermissionDenied

A SIGHUP reload of the file replaces its table: a connection notices at its
next op (the table it read from is not the file's any more) and reads its
token's role and scope again, by the token's fingerprint (the session never
keeps the token). A token the new file no longer holds may touch no key.

Thread safety: one :class:`ConnectionScope` per connection thread; the
fingerprint table shared by every connection is built under a lock.
"""

from __future__ import annotations

import threading

from kvstore.auth import AuthTable, Role, TokenFile, fingerprint
from kvstore.errors import NotFound, PermissionDenied
from kvstore.tenants import ALL, NO_TENANT, Scope, tenant_of

#: The roles that may read and write objects on the data port.
DATA_ROLES = frozenset({Role.CLIENT, Role.ADMIN, Role.NODE})
#: The roles that may read the node's store-wide STATS (an unscoped token's).
STATS_ROLES = frozenset({Role.ADMIN, Role.NODE})
_lock = threading.Lock()
_by_fingerprint: tuple[AuthTable | None, dict[str, tuple[Role, Scope]]] = (None, {})


def credentials_of_fingerprint(table: AuthTable, fp: str) -> tuple[Role | None, Scope]:
    """The role and scope ``table`` gives the token of :func:`~kvstore.auth.fingerprint`
    ``fp`` (no role and no tenant when it holds no such token). One table's
    fingerprints are computed once, for every connection."""
    global _by_fingerprint
    with _lock:
        known, found = _by_fingerprint
        if known is not table:
            found = {fingerprint(t): (role, table.scope_of_token(t))
                     for t, role in table.roles.items()}
            _by_fingerprint = (table, found)
    return found.get(fp, (None, NO_TENANT))


class ConnectionScope:
    """One connection's role and tenants: admin and every key without ``--auth``
    (``tokens`` None), none until :meth:`proved`, then its token's, following reloads."""

    __slots__ = ("tokens", "role", "scope", "fingerprint", "_table")

    def __init__(self, tokens: TokenFile | None):
        self.tokens = tokens
        self.role: Role | None = Role.ADMIN if tokens is None else None
        self.scope: Scope = ALL if tokens is None else NO_TENANT
        self.fingerprint = ""
        self._table: AuthTable | None = None

    def proved(self, role: Role, fp: str, scope: Scope) -> Role:
        """The handshake matched the token of fingerprint ``fp``, of ``role`` and
        ``scope``; returns ``role``."""
        self.role, self.fingerprint, self.scope = role, fp, scope
        self._table = None               # read again from the file's table at the first op
        return role

    def _refresh(self) -> None:
        table = self.tokens.table
        if table is not self._table:     # the first op, or the file was reloaded
            self._table = table
            role, self.scope = credentials_of_fingerprint(table, self.fingerprint)
            if role is not None:         # a token removed keeps its role and sees no key
                self.role = role

    def check_role(self) -> None:
        """Raises PermissionDenied unless the connection's role may use the object ops
        (client, admin, node): the same answer for every key."""
        if self.tokens is not None:
            self._refresh()
            if self.role not in DATA_ROLES:
                raise PermissionDenied(f"a {self.role.value if self.role else 'unknown'} "
                                       f"token may not read or write objects on a node's "
                                       f"data port (client, node or admin tokens may)")

    def check_stats(self) -> None:
        """Raises PermissionDenied unless the connection may read the node's store-wide
        figures (STATS): an admin or node token, or no ``--auth``."""
        if self.tokens is not None:
            self._refresh()
            if self.role not in STATS_ROLES:
                raise PermissionDenied("a node's STATS are an admin's or a node's (its "
                                       "store-wide figures); this token's role or scope "
                                       "does not see every tenant")

    def reads_everything(self) -> bool:
        """Whether the connection may read every key now (no ``--auth``, or a proven
        token of a data role whose scope is every tenant, as the file says now)."""
        if self.tokens is None:
            return True
        self._refresh()
        return self.role in DATA_ROLES and self.scope.everything

    def allows(self, key: str) -> bool:
        """Whether the connection may touch ``key`` (always without --auth).

        Raises:
            PermissionDenied: the connection's role may not use object ops at all.
        """
        if self.tokens is None:
            return True
        self.check_role()
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


def own_parent(key: str, parent: str) -> str | None:
    """The parent key a PUT names (None for ""), if it is of the key's own tenant: a
    prefix chain never crosses tenants (a namespace has one), and a parent of another
    tenant would let a writer reach into that tenant's eviction order. Else None."""
    if not parent or parent[:1] == "@" or key[:1] == "@":
        if not parent or tenant_of(parent) != tenant_of(key):
            return None
    return parent
