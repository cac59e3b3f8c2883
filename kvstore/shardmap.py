"""Hash slots and the versioned shard map.

Keys map to ``NUM_SLOTS`` (16384) hash slots (:func:`kvstore.keys.key_slot`);
contiguous slot ranges map to master shards. Clients route every key by its
slot; a master answers WRONG_SHARD with a redirect for a slot it does not own.
A shard is served by one or more masters (a leader and standbys, elected
through etcd): its ``addresses``, tried in turn. On the command line a
static map is written ``"a0|a0standby,a1|a1standby"`` (:meth:`ShardMap.parse`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from kvstore.binding import split_address
from kvstore.errors import InvalidArgument
from kvstore.keys import NUM_SLOTS, key_slot


@dataclass(frozen=True, slots=True)
class ShardRange:
    first_slot: int                 # inclusive
    last_slot: int                  # inclusive
    addresses: tuple[str, ...]      # the shard's masters, host:port: leader and standbys
    shard_id: int

    def __str__(self) -> str:
        return "|".join(self.addresses)


@dataclass(frozen=True, slots=True)
class ShardMap:
    version: int
    ranges: tuple[ShardRange, ...]
    num_slots: int = NUM_SLOTS

    @staticmethod
    def single(address: str, version: int = 1) -> "ShardMap":
        """One shard, served by one master, owning every slot (embedded mode)."""
        return ShardMap(version, (ShardRange(0, NUM_SLOTS - 1, (address,), 0),))

    @staticmethod
    def even(shards: list[tuple[str, ...]], version: int = 1) -> "ShardMap":
        """Slots split evenly over ``shards`` (each its masters' addresses), in order."""
        n = len(shards)
        ranges = []
        for i, addrs in enumerate(shards):
            first = i * NUM_SLOTS // n
            last = (i + 1) * NUM_SLOTS // n - 1
            ranges.append(ShardRange(first, last, tuple(addrs), i))
        return ShardMap(version, tuple(ranges))

    @staticmethod
    def parse(spec: str) -> "ShardMap":
        """A static map from ``"a0|a0b,a1,..."`` (one shard per comma-separated entry,
        its masters separated by ``|``; slots split evenly) or the path of a JSON
        file: ``{"version": 1, "masters": ["a0|a0b", ...]}`` or ``{"version": 1,
        "ranges": [{"first_slot": 0, "last_slot": 8191, "address": "a0|a0b",
        "shard_id": 0}, ...]}``.

        Raises:
            ValueError: a malformed spec or file.
        """
        if os.path.isfile(spec):
            with open(spec) as f:
                doc = json.load(f)
            version = int(doc.get("version", 1))
            if "masters" in doc:
                return ShardMap.even([_masters(a) for a in doc["masters"]], version)
            try:
                return ShardMap(version, tuple(ShardRange(int(r["first_slot"]), int(r["last_slot"]),
                                                          _masters(r["address"]),
                                                          int(r["shard_id"]))
                                               for r in doc["ranges"]))
            except (KeyError, TypeError) as exc:
                raise ValueError(f"shard map {spec}: bad ranges ({exc})") from None
        shards = [_masters(a) for a in spec.split(",") if a.strip()]
        if not shards:
            raise ValueError(f"empty shard map {spec!r}")
        return ShardMap.even(shards)

    def shard_for_slot(self, slot: int) -> ShardRange:
        for r in self.ranges:
            if r.first_slot <= slot <= r.last_slot:
                return r
        raise AssertionError(f"slot {slot} is in no range of shard map v{self.version}")

    def shard_for_key(self, key: str) -> ShardRange:
        return self.shard_for_slot(key_slot(key))


def _masters(entry: str) -> tuple[str, ...]:
    """``"a|b"`` -> ``("a", "b")``: one shard's masters."""
    addrs = tuple(a.strip() for a in entry.split("|") if a.strip())
    if not addrs:
        raise ValueError(f"a shard with no master address: {entry!r}")
    for a in addrs:
        try:
            split_address(a)
        except InvalidArgument as exc:
            raise ValueError(f"shard map: {exc.message}") from None
    return addrs
