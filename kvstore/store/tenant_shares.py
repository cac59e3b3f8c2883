"""A store node's tenants' guaranteed shares: whose objects eviction takes first.

A tenant's ``share`` (its ``tenant`` line in the ``--auth`` file, see
:mod:`kvstore.tenants`) is the part of the node's memory it is guaranteed:
bytes, or a percentage of the node's DRAM capacity. When the node must give
objects up (a tier over its watermark, a write waiting for room, the object
limit), the victims come first from tenants above their share, in the
policy's order; a tenant within its share loses objects only when no object
of a tenant above its share may go (:meth:`Tiering._victims
<kvstore.store.tiering.Tiering._victims>`)::

    pass 1   the policy's victims whose tenant holds more than its share
    pass 2   every victim (what pass 1 could not free)

A tenant with no ``tenant`` line, or none with ``share=``, has a share of 0:
any object of it is above its share.

Room made for a put of tenant T (:meth:`TenantShares.victims_for`) is
stricter: a tenant within its share loses objects for it only while T, with
the new value, is within T's own share. Otherwise the victims are only the
objects of T and of tenants above their share, and when those do not free
enough the put fails NoSpace naming T, evicting nobody within their share
(a put nobody gave T room for must not take another tenant's guaranteed
bytes). Background reclaim (a tier over its watermark, a promotion, a
demotion's room below) keeps the two passes above.

A put larger than its tenant's hard limit (``bytes=``, the store-wide limit
the master enforces at STORED) can never be stored: :meth:`check_limit`
refuses it at once, before anything is evicted.

Bytes are counted per tenant while objects are in service (from the start of
their write to their retirement; every tier: on a DRAM-only node, its DRAM),
only while some tenant has a share: a node without shares counts nothing,
and shares given by a reload (SIGHUP) start with one count of the objects.

Cost: pass 1 skips the objects of tenants within their share that come first
in the policy's order (each a heap pop and a restore: O(log n)); a tenant
within its share whose objects are the oldest makes each eviction skip them.

Thread safety: owned by the node's lock (:class:`~kvstore.store.table.ObjectTable`).
"""

from __future__ import annotations

from typing import Callable

from kvstore import tenants as tn
from kvstore.errors import NoSpace
from kvstore.sizes import format_size

#: An eviction pass's filter: whether the object of this key may go (None: any may).
KeyFilter = Callable[[str], bool] | None


class TenantShares:
    """Per-tenant bytes in service and guaranteed shares on one node.

    Args:
        table: the node's :class:`~kvstore.store.table.ObjectTable` (its lock, its
            objects, its DRAM capacity).

    Attributes:
        active: some tenant has a share (bytes are counted only then).
        shares: tenant -> guaranteed bytes on this node.
        held: tenant -> bytes of its objects in service (while active).
        max_bytes: tenant -> its hard limit on bytes (store-wide), of the tenants with one.

    Thread safety: :meth:`configure` and :meth:`snapshot` take the node's lock; the
    others run with it held (the table's callers).
    """

    __slots__ = ("_table", "active", "shares", "held", "max_bytes")

    def __init__(self, table):
        self._table = table
        self.active = False
        self.shares: dict[str, int] = {}
        self.held: dict[str, int] = {}
        self.max_bytes: dict[str, int] = {}

    def configure(self, quotas: dict[str, tn.Quota]) -> None:
        """New quotas (the ``--auth`` file's, again on SIGHUP): the shares of the node's
        DRAM capacity; the objects in service are counted once when some share is set."""
        table = self._table
        with table.cond:
            capacity = table.levels[0].tier.capacity_bytes
            self.shares = {name: share for name, q in quotas.items()
                           if (share := q.share_of(capacity)) > 0}
            self.active = bool(self.shares)
            self.max_bytes = {name: q.max_bytes for name, q in quotas.items() if q.max_bytes}
            held: dict[str, int] = {}
            if self.active:
                for obj in table.objects.values():
                    t = tn.tenant_of(obj.key)
                    held[t] = held.get(t, 0) + obj.size_bytes
            self.held = held

    def snapshot(self) -> dict[str, tuple[int, int]]:
        """tenant -> (bytes held, share) of the tenants with either, while active."""
        with self._table.cond:
            return self.figures()

    def add(self, key: str, size_bytes: int) -> None:
        t = tn.tenant_of(key)
        self.held[t] = self.held.get(t, 0) + size_bytes

    def sub(self, key: str, size_bytes: int) -> None:
        t = tn.tenant_of(key)
        left = self.held.get(t, 0) - size_bytes
        if left > 0:
            self.held[t] = left
        else:
            self.held.pop(t, None)

    def above(self, key: str) -> bool:
        """Whether ``key``'s tenant holds more than its share (always, inactive)."""
        if not self.active:
            return True
        t = tn.tenant_of(key)
        return self.held.get(t, 0) > self.shares.get(t, 0)

    def check_limit(self, key: str, size_bytes: int) -> None:
        """Refuse a value that alone is larger than its tenant's hard limit on bytes.

        Raises:
            NoSpace: naming the tenant, the value's size and the limit.
        """
        if self.max_bytes:
            t = tn.tenant_of(key)
            limit = self.max_bytes.get(t, 0)
            if limit and size_bytes > limit:
                raise NoSpace(f"tenant {t}: put of {format_size(size_bytes)} refused: larger "
                              f"than its quota of {format_size(limit)} (the --auth file's "
                              f"tenant line); nothing was evicted for it", key=key)

    def within_after(self, key: str, size_bytes: int) -> bool:
        """Whether ``key``'s tenant, holding ``size_bytes`` more, is within its share."""
        t = tn.tenant_of(key)
        share = self.shares.get(t, 0)
        return share > 0 and self.held.get(t, 0) + size_bytes <= share

    def victims_for(self, put_key: str | None = None, put_size: int = 0) -> tuple[KeyFilter, ...]:
        """The eviction passes, in order: each pass's filter on the victims' keys.

        Background reclaim (``put_key`` None), or room for a put whose tenant stays
        within its share: (above their share, any). Room for a put of a tenant over
        its share with it: one pass, the put's tenant and tenants above their share.
        Inactive (no shares): one pass, any.
        """
        if not self.active:
            return (None,)
        if put_key is None or self.within_after(put_key, put_size):
            return (self.above, None)
        own = tn.tenant_of(put_key)
        return (lambda key: self.above(key) or tn.tenant_of(key) == own,)

    def restricted(self, put_key: str, put_size: int) -> bool:
        """Whether room for this put may come only from its tenant and tenants above
        their share (:meth:`victims_for`'s one pass)."""
        return self.active and not self.within_after(put_key, put_size)

    def may_give(self, tenant: str, evictable: int, largest: int) -> int:
        """At most how many bytes of ``tenant`` a restricted put's room takes: its
        ``evictable`` bytes, and (another tenant) only while it is above its share, so
        down to its share, past it by at most its ``largest`` evictable object."""
        share, held = self.shares.get(tenant, 0), self.held.get(tenant, 0)
        if not share:
            return evictable
        return 0 if held <= share else min(evictable, held - share + largest)

    def room_for(self, level: int, put_key: str, now: float) -> int:
        """At most how many bytes at ``level`` may go for a put of ``put_key``'s tenant
        restricted to its own objects and those of tenants above their share (each of
        those only down to its share: :meth:`may_give`). O(objects)."""
        own = tn.tenant_of(put_key)
        per: dict[str, list[int]] = {}         # tenant -> [evictable bytes, largest copy]
        for o in self._table.objects.values():
            copy = o.copy(level)
            if copy is None or not o.can_give_up(level, True, now):
                continue
            t = tn.tenant_of(o.key)
            if t != own and not self.above(o.key):
                continue
            found = per.setdefault(t, [0, 0])
            found[0] += copy.reserved_bytes
            found[1] = max(found[1], copy.reserved_bytes)
        return sum(ev if t == own else self.may_give(t, ev, largest)
                   for t, (ev, largest) in per.items())

    def over_share_message(self, key: str, size_bytes: int) -> str:
        """The start of a put's NoSpace message when its room is restricted (naming
        its tenant, its bytes here and its share), else ''."""
        if not self.restricted(key, size_bytes):
            return ""
        t = tn.tenant_of(key)
        return (f"tenant {t}: {format_size(self.held.get(t, 0))} on this node, its "
                f"guaranteed share {format_size(self.shares.get(t, 0))}: over it with this "
                f"put of {format_size(size_bytes)}, so only its own objects and those of "
                f"tenants above their share may go for it, and they do not free enough "
                f"(tenants within their share keep theirs): ")

    def figures(self) -> dict[str, tuple[int, int]]:
        """tenant -> (bytes held, share) of the tenants with either (while active)."""
        return {t: (self.held.get(t, 0), self.shares.get(t, 0))
                for t in sorted(set(self.held) | set(self.shares))}
