"""A master shard's tenants: their usage, their hard limits, and their counters.

Usage (objects, and bytes once per object whatever its replicas) is kept by the
native entry table per named tenant (keys ``"@NAME/..."``), at its one insert
and one remove, so every path that adds or deletes an entry (a put's commit, a
remove, an eviction, an inventory applied natively or not, a node forgotten)
keeps it, and reading it is one map lookup. The ``default`` tenant's usage is
the rest of the table (what no named tenant holds)::

    named tenant   native.tenant_usage(name)                           O(1)
    default        (entries, complete_bytes) - sum of the named ones   O(named tenants)

A put is checked where the master decides it, at its first STORED
(:meth:`ObjectIndex._stored_placed`): a new key that would take its tenant past
a hard limit (``bytes=`` or ``objects=`` of its ``tenant`` line, see
:mod:`kvstore.tenants`) is refused NoSpace naming the tenant and its figures;
the node drops the bytes, so nothing half-created stays. GrantPlacement of a
named key refuses at once a tenant already at a limit (no bytes move).

Limits are over the whole store: each shard holds the part of a tenant's keys
its slots hash to, so each shard enforces the same part of each limit (a shard
owning a quarter of the slots allows a quarter of the bytes; with one shard,
the whole limit).

Counters by tenant (``kvctl tenants``, ``kvstore_tenant_*``): puts, lookup hits
and misses, evictions (objects whose last replica was evicted), refusals (puts
over a limit). Puts and lookups count the named tenants' keys only (one
character compared per key on those hot paths); the default tenant's puts,
hits and misses are the shard's less the named ones'.

Thread safety: owned by the master's event loop, as the index.
"""

from __future__ import annotations

import enum
import math
from collections import Counter

from kvstore import tenants as tn
from kvstore.errors import NoSpace
from kvstore.master.counters import MasterCounter as C
from kvstore.sizes import format_size
from kvstore.types import TenantStatus


class TenantCounter(str, enum.Enum):
    """What a shard counts per tenant; valued as their names on the wire."""

    PUTS = "puts"                  # new keys made visible
    HITS = "hits"                  # keys looked up and found
    MISSES = "misses"              # ... not found
    EVICTIONS = "evictions"        # objects gone with their last replica's eviction
    REFUSALS = "refusals"          # puts refused NoSpace over a hard limit


def key_tenant(key: str) -> str:
    """The tenant name a key starting with "@" spells, unchecked (fast: no regex); a
    caller that needs the exact answer for names it does not know uses
    :func:`kvstore.tenants.tenant_of`."""
    i = key.find("/")
    return key[1:i] if 1 < i <= 65 else tn.DEFAULT_TENANT


def bump(counts: dict[str, int], key: str) -> None:
    """Count one for the tenant ``key`` (a key starting with "@") spells: the put and
    lookup paths' per-key cost (a str find and a dict add)."""
    i = key.find("/")
    name = key[1:i] if 1 < i <= 65 else tn.DEFAULT_TENANT
    counts[name] = counts.get(name, 0) + 1


class TenantBook:
    """Quotas and per-tenant counters of one shard.

    Args:
        quotas: tenant -> :class:`~kvstore.tenants.Quota` (the ``--auth`` file's
            ``tenant`` lines); replaced whole by :meth:`set_quotas` on reload.
        fraction: the part of the hash slots the shard owns (0 < f <= 1): the part of
            each hard limit it enforces.

    Attributes:
        counts: counter -> tenant -> count. Named tenants as their keys spell them
            (:func:`key_tenant`); :meth:`figures` keeps the valid names.
    """

    def __init__(self, quotas: dict[str, tn.Quota] | None = None, fraction: float = 1.0):
        self.fraction = fraction
        self.quotas: dict[str, tn.Quota] = {}
        self._limits: dict[str, tuple[int, int]] = {}   # tenant -> this shard's (bytes, objects)
        self.counts: dict[TenantCounter, dict[str, int]] = {c: {} for c in TenantCounter}
        # The hot paths' counters (:func:`bump`), the same dicts as in ``counts``.
        self.puts = self.counts[TenantCounter.PUTS]
        self.hits = self.counts[TenantCounter.HITS]
        self.misses = self.counts[TenantCounter.MISSES]
        self.set_quotas(quotas or {})

    def set_quotas(self, quotas: dict[str, tn.Quota]) -> None:
        """New quotas (SIGHUP): in force from the next put on."""
        self.quotas = dict(quotas)
        self._limits = {name: (self._part(q.max_bytes), self._part(q.max_objects))
                        for name, q in quotas.items() if q.max_bytes or q.max_objects}

    def count(self, tenant: str, what: TenantCounter, n: int = 1) -> None:
        d = self.counts[what]
        d[tenant] = d.get(tenant, 0) + n

    def _part(self, limit: int) -> int:
        """This shard's part of a store-wide ``limit`` (at least 1 when ``limit`` is set)."""
        return 0 if not limit else max(1, math.ceil(limit * self.fraction))

    # ---- usage ----
    @staticmethod
    def usage(index, tenant: str) -> tuple[int, int]:
        """(objects, bytes) of ``tenant``'s entries on ``index``'s shard."""
        native = index.table.native
        if tenant != tn.DEFAULT_TENANT:
            return native.tenant_usage(tenant)
        objects, size = len(native), index.complete_bytes
        for o, b in native.tenants().values():
            objects -= o
            size -= b
        return objects, size

    # ---- the hard limits ----
    def _limited(self, key: str) -> tuple[str, int, int] | None:
        """(tenant, max bytes, max objects on this shard) of ``key``'s tenant, or None."""
        limits = self._limits
        tenant = key_tenant(key) if key[:1] == "@" else tn.DEFAULT_TENANT
        found = limits.get(tenant)
        if found is None and tenant != tn.DEFAULT_TENANT:
            tenant = tn.tenant_of(key)            # "@" and no valid name: the default's
            found = limits.get(tenant)
        return None if found is None else (tenant, *found)

    def check_put(self, index, key: str, size_bytes: int) -> None:
        """Refuse a new key of ``size_bytes`` that would take its tenant past a hard limit.

        Raises:
            NoSpace: the message names the tenant, its figures and the put.
        """
        limited = self._limited(key)
        if limited is None:
            return
        tenant, max_bytes, max_objects = limited
        objects, used = self.usage(index, tenant)
        if max_bytes and used + size_bytes > max_bytes:
            self._refuse(tenant, key, f"{format_size(used)} of {format_size(max_bytes)} used, "
                         f"put of {format_size(size_bytes)} refused")
        if max_objects and objects + 1 > max_objects:
            self._refuse(tenant, key, f"{objects} of {max_objects} objects stored, put of "
                         f"{format_size(size_bytes)} refused")

    def check_grant(self, index, key: str) -> None:
        """Refuse a grant for ``key`` whose tenant is at a hard limit already (no size yet).

        Raises:
            NoSpace: as :meth:`check_put`.
        """
        limited = self._limited(key)
        if limited is None:
            return
        tenant, max_bytes, max_objects = limited
        objects, used = self.usage(index, tenant)
        if max_bytes and used >= max_bytes:
            self._refuse(tenant, key, f"{format_size(used)} of {format_size(max_bytes)} used, "
                         f"no put fits")
        if max_objects and objects >= max_objects:
            self._refuse(tenant, key, f"{objects} of {max_objects} objects stored, no put fits")

    def _refuse(self, tenant: str, key: str, figures: str) -> None:
        self.count(tenant, TenantCounter.REFUSALS)
        where = (f" (this shard's part of its limits: {self.fraction:.3g} of the slots)"
                 if self.fraction < 1 else "")
        raise NoSpace(f"tenant {tenant}: {figures}: over its quota{where}; remove some of "
                      f"its objects or raise its limit (the --auth file's tenant line)",
                      key=key)

    # ---- figures ----
    def figures(self, index, scope: tn.Scope = tn.ALL) -> list[TenantStatus]:
        """The tenants of ``index``'s shard that ``scope`` allows and that have entries, a
        quota or a count (the default tenant always), by name."""
        shard = index.counters       # all tenants': the default's are these less the named ones'
        rest = {TenantCounter.PUTS: shard[C.PUTS], TenantCounter.HITS: shard[C.LOOKUP_HITS],
                TenantCounter.MISSES: shard[C.LOOKUP_MISSES]}
        held = index.table.native.tenants()
        named = {n for d in self.counts.values() for n in d if tn.TENANT_NAME.match(n)}
        named |= set(held) | set(self.quotas)
        named.discard(tn.DEFAULT_TENANT)
        for what in rest:
            rest[what] -= sum(self.counts[what].get(n, 0) for n in named)
        out = []
        for name in sorted(named | {tn.DEFAULT_TENANT}):
            if not scope.allows_tenant(name):
                continue
            default = name == tn.DEFAULT_TENANT
            objects, size = self.usage(index, name) if default else held.get(name, (0, 0))
            counts = {c.value: (max(0, rest[c]) if default and c in rest
                                else self.counts[c].get(name, 0)) for c in TenantCounter}
            quota = self.quotas.get(name, tn.NO_QUOTA)
            out.append(TenantStatus(name, objects, size, self._part(quota.max_objects),
                                     self._part(quota.max_bytes), counts))
        return out
