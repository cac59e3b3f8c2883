"""A store node's limit on objects: refused with numbers before the node runs out of memory.

Each object a node holds costs its process memory beyond the value itself
(the table's record, its copies, the allocator's extent, the eviction
policy's entry): :data:`NODE_BYTES_PER_OBJECT`, measured by ``kvstore
scale``. A node holds at most ``max_objects`` (``--max-objects``; default
:func:`default_max_objects`); a write of one more first evicts the coldest
object where a tier's policy evicts, else it is NO_SPACE, saying so.
Objects recovered from the SSD at a restart are kept, beyond the limit too.
"""

from __future__ import annotations

#: What one object costs a node process beyond its value (B), with a margin: `kvstore scale`
#: measured 183 B at 10M objects with kvstore's own (hex) keys; a tier that evicts adds
#: about 105 B of ghost history per object held, and a key of another form 88 B of
#: string (twice with a parent of that form); see docs/operations.md, Scale and limits.
NODE_BYTES_PER_OBJECT = 600

#: No limit.
UNLIMITED = 2**63 - 1


def default_max_objects(memory_bytes: int, dram_bytes: int) -> int:
    """Objects a node holds by default: half of what ``memory_bytes`` (the process's
    memory limit) leaves beside its DRAM tier, at :data:`NODE_BYTES_PER_OBJECT`
    each; no limit when the memory is unknown (0)."""
    if not memory_bytes:
        return UNLIMITED
    return max(1, (memory_bytes - dram_bytes) // 2 // NODE_BYTES_PER_OBJECT)
