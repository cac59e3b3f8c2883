"""Hash slots and the versioned shard map.

Keys map to ``NUM_SLOTS`` (16384) hash slots (:func:`kvstore.keys.key_slot`);
contiguous slot ranges map to master shards. Clients route every key by its
slot; a master answers WRONG_SHARD with a redirect for a slot it does not own.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from kvstore._proto import kvstore_pb2 as pb
from kvstore.keys import NUM_SLOTS, key_slot


@dataclass(frozen=True, slots=True)
class ShardRange:
    first_slot: int   # inclusive
    last_slot: int    # inclusive
    address: str      # master address host:port
    shard_id: int


@dataclass(frozen=True, slots=True)
class ShardMap:
    version: int
    ranges: tuple[ShardRange, ...]
    num_slots: int = NUM_SLOTS

    @staticmethod
    def single(address: str, version: int = 1) -> "ShardMap":
        """One shard owning every slot (embedded mode)."""
        return ShardMap(version, (ShardRange(0, NUM_SLOTS - 1, address, 0),))

    @staticmethod
    def even(addresses: list[str], version: int = 1) -> "ShardMap":
        """Slots split evenly over ``addresses`` in order."""
        n = len(addresses)
        ranges = []
        for i, addr in enumerate(addresses):
            first = i * NUM_SLOTS // n
            last = (i + 1) * NUM_SLOTS // n - 1
            ranges.append(ShardRange(first, last, addr, i))
        return ShardMap(version, tuple(ranges))

    @staticmethod
    def parse(spec: str) -> "ShardMap":
        """A static map from ``"addr0,addr1,..."`` (slots split evenly) or the path of
        a JSON file: ``{"version": 1, "masters": ["addr0", ...]}`` or ``{"version": 1,
        "ranges": [{"first_slot": 0, "last_slot": 8191, "address": "...", "shard_id": 0},
        ...]}``.

        Raises:
            ValueError: a malformed spec or file.
        """
        if os.path.isfile(spec):
            with open(spec) as f:
                doc = json.load(f)
            version = int(doc.get("version", 1))
            if "masters" in doc:
                return ShardMap.even(list(doc["masters"]), version)
            try:
                return ShardMap(version, tuple(ShardRange(int(r["first_slot"]), int(r["last_slot"]),
                                                          r["address"], int(r["shard_id"]))
                                               for r in doc["ranges"]))
            except (KeyError, TypeError) as exc:
                raise ValueError(f"shard map {spec}: bad ranges ({exc})") from None
        addrs = [a.strip() for a in spec.split(",") if a.strip()]
        if not addrs:
            raise ValueError(f"empty shard map {spec!r}")
        return ShardMap.even(addrs)

    def shard_for_slot(self, slot: int) -> ShardRange:
        for r in self.ranges:
            if r.first_slot <= slot <= r.last_slot:
                return r
        raise AssertionError(f"slot {slot} is in no range of shard map v{self.version}")

    def shard_for_key(self, key: str) -> ShardRange:
        return self.shard_for_slot(key_slot(key))

    def to_proto(self) -> pb.ShardMap:
        return pb.ShardMap(version=self.version, num_slots=self.num_slots, ranges=[
            pb.ShardRange(first_slot=r.first_slot, last_slot=r.last_slot, address=r.address,
                          shard_id=r.shard_id) for r in self.ranges])

    @staticmethod
    def from_proto(msg: pb.ShardMap) -> "ShardMap":
        return ShardMap(msg.version, tuple(ShardRange(r.first_slot, r.last_slot, r.address,
                                                      r.shard_id) for r in msg.ranges),
                        msg.num_slots or NUM_SLOTS)
