"""A master shard's limits: what it holds at most, and what it refuses to be told.

    inventory ids      a node announces object ids in [1, :data:`MAX_INVENTORY_OBJECT_ID`]
                       (:func:`check_inventory`). New ids continue above every id seen,
                       and a leader's begin at its etcd revision << 32 (< 2^63), so 2^63
                       ids are left to hand out; an announced 2^64 - 1 would leave none:
                       the next id would not fit the wire's uint64, and every later put,
                       and every drop order in a heartbeat reply, would fail.
    inventory replicas an item's ``replica_num`` is at most :data:`kvstore.rpc.MAX_REPLICAS`,
                       as a put's: a larger one would have the master copy an object
                       to every node.
    objects            at most ``max_objects`` objects indexed (``--max-objects``; default
                       :func:`default_max_objects`: half the memory at
                       :data:`MASTER_BYTES_PER_OBJECT` each); a put of a new key beyond
                       it is NO_SPACE, saying so, before the master runs out of memory.
                       An inventory is indexed whole, beyond it too: those objects exist
                       on a node already, and it is counted (``inventory_over_limit``).
    inventory chunks   a SyncInventory chunk holds at most :data:`MAX_INVENTORY_CHUNK`
                       items (a few hundred KiB); a node's inventory is any number of
                       them.

Calls carry at most :data:`kvstore.rpc.MAX_KEYS_PER_CALL` keys (checked by the servicer).
"""

from __future__ import annotations

from typing import Sequence

from kvstore.errors import InvalidArgument
from kvstore.rpc import check_replica_num
from kvstore.types import InventoryItem

#: What one indexed object costs a master process (B), measured by ``kvstore scale``
#: (64-byte values, 32-character keys, one replica): see docs/operations.md, Scale and limits.
#: The native entry table measures 105 B at 2M objects and 89 B at 10M; the margin covers a bucket
#: array's growth (it doubles one 256th of the table at a time) and the Python side
#: (superseded keys, drop orders, a registration's listed bytes).
MASTER_BYTES_PER_OBJECT = 150
MAX_INVENTORY_CHUNK = 8192
MAX_INVENTORY_OBJECT_ID = 2**63 - 1


def default_max_objects(memory_bytes: int) -> int:
    """Objects a master indexes by default: half of ``memory_bytes`` (the process's
    memory limit) at :data:`MASTER_BYTES_PER_OBJECT` each; no limit when unknown (0)."""
    return memory_bytes // 2 // MASTER_BYTES_PER_OBJECT if memory_bytes else 2**63 - 1


def check_inventory(items: Sequence[InventoryItem]) -> None:
    """Refuse an inventory no node could hold (called before anything is changed).

    Raises:
        InvalidArgument: an object id of 0 or above :data:`MAX_INVENTORY_OBJECT_ID`, or
            a ``replica_num`` above :data:`kvstore.rpc.MAX_REPLICAS`.
    """
    for it in items:
        check_replica_num(it.replica_num, unset_ok=True,
                          what=f"inventory replica_num of {it.key[:64]!r}")
        if not 0 < it.object_id <= MAX_INVENTORY_OBJECT_ID:
            raise InvalidArgument(f"inventory object id {it.object_id} of {it.key[:64]!r} is "
                                  f"outside [1, {MAX_INVENTORY_OBJECT_ID}]")
