"""A store node's object table: what it holds, who is reading it, what to free.

The node owns its memory. Objects are written once and then immutable; a
reader holds a reference for as long as it reads, and memory with a
reference is never freed or reused (no time-based lease decides that)::

    begin_write --> WRITING --commit_write (checksum ok)--> COMPLETE --drop--> doomed
         |                                                     |               |
         +--abort_write / bad checksum--> freed    acquire/release (refs)   freed when refs == 0

Each object is named by (key, object_id): the master issues a fresh
object_id per put, so a drop order for an old version never frees a newer one.

Thread safety: every public method takes the node's lock; the data server
calls it from one thread per connection. Value bytes are copied outside
the lock (a reference or a WRITING state keeps the memory in place).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass, field

from kvstore.errors import ChecksumMismatch, InvalidArgument, NoSpace, NotFound, TooLarge
from kvstore.keys import value_checksum
from kvstore.store.allocator import Allocation
from kvstore.store.eviction import make_policy
from kvstore.store.tiers.dram import DramTier

log = logging.getLogger(__name__)


class ObjectState(enum.Enum):
    WRITING = 1    # space reserved, bytes arriving
    COMPLETE = 2   # checksum verified, readable


@dataclass(slots=True, eq=False)
class StoredObject:
    key: str
    object_id: int             # the master's id of this version
    alloc: Allocation          # where the bytes live in the DRAM tier
    checksum: int              # xxh3-64 announced by the writer
    state: ObjectState = ObjectState.WRITING
    refs: int = 0              # readers in flight; > 0 pins the memory
    parent: str | None = None  # previous block of its prefix chain (eviction hint)
    doomed: bool = False       # out of service; if still referenced, freed at last release
    last_access_s: float = field(default_factory=time.monotonic)

    @property
    def size_bytes(self) -> int:
        return self.alloc.size_bytes


@dataclass(frozen=True, slots=True)
class NodeStats:
    capacity_bytes: int
    used_bytes: int
    free_bytes: int
    num_objects: int         # COMPLETE objects
    num_writing: int
    num_referenced: int      # objects with a reader in flight
    num_doomed: int
    num_evictable: int       # complete objects no reader holds
    evictions: int           # objects evicted since start


class StoreNode:
    """The object table of one node over its DRAM tier.

    Eviction is local to the node: when a write does not fit, or a commit
    takes the tier above ``high_watermark``, the policy proposes victims
    and the node evicts those no reader holds, down to ``low_watermark``.
    Every eviction is queued as an event for the master (:meth:`take_events`),
    and ``events_ready`` is set so the node's agent reports it at once.

    Args:
        tier: the DRAM tier holding the bytes.
        policy: eviction policy name (``kvstore.store.eviction`` registry).
        high_watermark, low_watermark: fractions of capacity.
    """

    def __init__(self, tier: DramTier, policy: str = "default", high_watermark: float = 0.95,
                 low_watermark: float = 0.85):
        if not 0 < low_watermark <= high_watermark <= 1:
            raise ValueError(f"need 0 < low ({low_watermark}) <= high ({high_watermark}) <= 1")
        self.tier = tier
        self.policy = make_policy(policy)
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self._lock = threading.Lock()
        self._objects: dict[str, StoredObject] = {}
        self._doomed: set[StoredObject] = set()
        self._events: list[tuple[str, int]] = []     # (key, object_id) evicted, not yet reported
        self.events_ready = threading.Event()
        self.counters: dict[str, int] = {"puts": 0, "gets": 0, "drops": 0, "checksum_errors": 0,
                                         "evictions": 0}

    # ---- write ----
    def begin_write(self, key: str, object_id: int, size_bytes: int, checksum: int,
                    parent: str | None = None) -> tuple[StoredObject, bool]:
        """Reserve space for a new object.

        Returns:
            ``(obj, already_present)``: when this exact version is already
            complete, ``already_present`` is True and nothing must be written.

        Raises:
            InvalidArgument: negative size.
            TooLarge: larger than the whole tier.
            NoSpace: no free extent is large enough, even after evicting
                every object no reader holds.
        """
        if size_bytes < 0:
            raise InvalidArgument(f"size_bytes must be >= 0, got {size_bytes}", key=key)
        if size_bytes > self.tier.capacity_bytes:
            raise TooLarge(f"{size_bytes} B exceeds the node's capacity of "
                           f"{self.tier.capacity_bytes} B", key=key)
        with self._lock:
            old = self._objects.get(key)
            if old is not None and old.object_id == object_id:
                if old.state is ObjectState.COMPLETE and old.checksum == checksum:
                    return old, True
                if old.state is ObjectState.WRITING:
                    raise InvalidArgument("this version is being written already", key=key)
            alloc = self._allocate_locked(size_bytes)
            if alloc is None:
                busy = sum(o.refs > 0 for o in self._objects.values())
                raise NoSpace(f"no free extent of {size_bytes} B (free {self.tier.free_bytes} B, "
                              f"largest {self.tier.allocator.largest_free_bytes} B) and nothing "
                              f"evictable ({busy} objects being read or written, "
                              f"{len(self._doomed)} awaiting their last reader)", key=key)
            if old is not None:
                self._retire(old)
            # The writer holds a reference until commit or abort, so a drop
            # during the write never frees memory that is still being filled.
            obj = StoredObject(key, object_id, alloc, checksum, refs=1, parent=parent)
            self._objects[key] = obj
            return obj, False

    def write_view(self, obj: StoredObject) -> memoryview:
        """Where the writer puts the value (valid while ``obj`` is WRITING)."""
        return self.tier.view(obj.alloc)

    def commit_write(self, obj: StoredObject) -> None:
        """Verify the checksum and make the object readable.

        Raises:
            ChecksumMismatch: the bytes are not what the writer announced;
                the space is freed and nothing stays behind.
        """
        actual = value_checksum(self.tier.view(obj.alloc))
        with self._lock:
            if actual != obj.checksum:
                self.counters["checksum_errors"] += 1
                self._retire(obj)
                self._release_locked(obj)
                raise ChecksumMismatch(f"checksum {actual:#x} != announced {obj.checksum:#x}",
                                       key=obj.key)
            if obj.doomed:
                # Dropped while being written: the writer loses, memory goes back.
                self._release_locked(obj)
                raise NotFound("object was dropped while being written", key=obj.key)
            obj.state = ObjectState.COMPLETE
            self._release_locked(obj)
            self.counters["puts"] += 1
            self.policy.on_insert(obj.key, obj.alloc.reserved_bytes, time.monotonic(), obj.parent)
            self._enforce_watermark_locked()

    def abort_write(self, obj: StoredObject) -> None:
        """Give back the space of an unfinished write."""
        with self._lock:
            if obj.state is ObjectState.WRITING:
                self._retire(obj)
                self._release_locked(obj)

    # ---- read ----
    def acquire(self, key: str, object_id: int = 0) -> StoredObject:
        """Take a read reference on a complete object (``object_id`` 0 = any version).

        Raises:
            NotFound: no complete object under this key (and version).
        """
        with self._lock:
            obj = self._objects.get(key)
            if obj is None or obj.state is not ObjectState.COMPLETE or (
                    object_id and obj.object_id != object_id):
                raise NotFound("not on this node", key=key)
            obj.refs += 1
            obj.last_access_s = time.monotonic()
            self.policy.on_access(key, obj.last_access_s)
            self.counters["gets"] += 1
            return obj

    def read_view(self, obj: StoredObject) -> memoryview:
        """The object's bytes (valid while the caller holds its reference)."""
        return self.tier.view(obj.alloc)

    def release(self, obj: StoredObject) -> None:
        """Drop a read reference taken by :meth:`acquire`."""
        with self._lock:
            self._release_locked(obj)

    # ---- removal ----
    def drop(self, key: str, object_id: int = 0) -> bool:
        """Free an object (``object_id`` 0 = whatever version is there).

        Memory under a reader is freed when the last reader releases it.
        Returns True when an object was dropped.
        """
        with self._lock:
            obj = self._objects.get(key)
            if obj is None or (object_id and obj.object_id != object_id):
                return False
            self._retire(obj)
            self.counters["drops"] += 1
            return True

    def take_events(self) -> list[tuple[str, int]]:
        """Evictions not yet reported to the master: (key, object_id), in order."""
        with self._lock:
            events, self._events = self._events, []
            self.events_ready.clear()
            return events

    def inventory(self) -> list[tuple[str, int, int, int]]:
        """(key, object_id, size_bytes, checksum) of every complete object."""
        with self._lock:
            return [(o.key, o.object_id, o.size_bytes, o.checksum)
                    for o in self._objects.values() if o.state is ObjectState.COMPLETE]

    def stats(self) -> NodeStats:
        with self._lock:
            objs = list(self._objects.values())
            return NodeStats(
                capacity_bytes=self.tier.capacity_bytes,
                used_bytes=self.tier.used_bytes,
                free_bytes=self.tier.free_bytes,
                num_objects=sum(o.state is ObjectState.COMPLETE for o in objs),
                num_writing=sum(o.state is ObjectState.WRITING for o in objs),
                num_referenced=sum(o.refs > 0 and o.state is ObjectState.COMPLETE for o in objs),
                num_doomed=len(self._doomed),
                num_evictable=sum(self._can_evict(o.key) for o in objs),
                evictions=self.counters["evictions"],
            )

    # ---- internals (lock held) ----
    def _can_evict(self, key: str) -> bool:
        obj = self._objects.get(key)
        return obj is not None and obj.refs == 0 and obj.state is ObjectState.COMPLETE

    def _evict_locked(self, key: str) -> None:
        obj = self._objects[key]
        self._retire(obj)
        self._events.append((obj.key, obj.object_id))
        self.counters["evictions"] += 1
        self.events_ready.set()

    def _allocate_locked(self, size_bytes: int) -> Allocation | None:
        """Allocate, evicting policy victims one by one until the extent fits."""
        alloc = self.tier.allocate(size_bytes)
        if alloc is not None:
            return alloc
        for key in self.policy.victims(None, can_evict=self._can_evict):
            self._evict_locked(key)
            alloc = self.tier.allocate(size_bytes)
            if alloc is not None:
                return alloc
        return None

    def _enforce_watermark_locked(self) -> None:
        cap = self.tier.capacity_bytes
        if self.tier.used_bytes <= self.high_watermark * cap:
            return
        excess = self.tier.used_bytes - int(self.low_watermark * cap)
        for key in self.policy.victims(excess, can_evict=self._can_evict):
            self._evict_locked(key)

    def _release_locked(self, obj: StoredObject) -> None:
        if obj.refs <= 0:
            raise AssertionError(f"release without a reference on {obj.key}")
        obj.refs -= 1
        if obj.refs == 0 and obj.doomed:
            self._doomed.discard(obj)
            self._free(obj)

    def _retire(self, obj: StoredObject) -> None:
        """Take ``obj`` out of service: free now, or at its last release."""
        if obj.doomed:
            return
        if self._objects.get(obj.key) is obj:
            del self._objects[obj.key]
        obj.doomed = True
        if obj.state is ObjectState.COMPLETE:
            self.policy.on_remove(obj.key)
        if obj.refs > 0:
            self._doomed.add(obj)
        else:
            self._free(obj)

    def _free(self, obj: StoredObject) -> None:
        self.tier.free(obj.alloc)
