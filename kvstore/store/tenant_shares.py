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

from kvstore import tenants as tn


class TenantShares:
    """Per-tenant bytes in service and guaranteed shares on one node.

    Args:
        table: the node's :class:`~kvstore.store.table.ObjectTable` (its lock, its
            objects, its DRAM capacity).

    Attributes:
        active: some tenant has a share (bytes are counted only then).
        shares: tenant -> guaranteed bytes on this node.
        held: tenant -> bytes of its objects in service (while active).

    Thread safety: :meth:`configure` and :meth:`snapshot` take the node's lock; the
    others run with it held (the table's callers).
    """

    __slots__ = ("_table", "active", "shares", "held")

    def __init__(self, table):
        self._table = table
        self.active = False
        self.shares: dict[str, int] = {}
        self.held: dict[str, int] = {}

    def configure(self, quotas: dict[str, tn.Quota]) -> None:
        """New quotas (the ``--auth`` file's, again on SIGHUP): the shares of the node's
        DRAM capacity; the objects in service are counted once when some share is set."""
        table = self._table
        with table.cond:
            capacity = table.levels[0].tier.capacity_bytes
            self.shares = {name: share for name, q in quotas.items()
                           if (share := q.share_of(capacity)) > 0}
            self.active = bool(self.shares)
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

    def figures(self) -> dict[str, tuple[int, int]]:
        """tenant -> (bytes held, share) of the tenants with either (while active)."""
        return {t: (self.held.get(t, 0), self.shares.get(t, 0))
                for t in sorted(set(self.held) | set(self.shares))}
