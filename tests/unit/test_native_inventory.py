"""Inventory chunks decoded and applied natively (kvstore/native/inventory_wire.hpp,
entry_inventory.hpp) against the Python reading and rules they replace on the hot path:
the bytes encode_inventory makes are protobuf's, decoding refuses what protobuf refuses,
and a chunk applied natively leaves the index exactly as the Python rules do
(kvstore.master.inventory), whatever the index held before."""

from __future__ import annotations

import asyncio
import random

import pytest
import xxhash

from kvstore import _native, wire
from kvstore._proto import kvstore_pb2 as pb
from kvstore.errors import InvalidArgument
from kvstore.master.index import ObjectIndex
from kvstore.master.limits import MAX_INVENTORY_CHUNK
from kvstore.master.membership import Membership, NodeRegistration
from kvstore.master import registration as registration_module
from kvstore.master.registration import Registrations
from kvstore.master.roster import Roster
from kvstore.master.servicer import decode_sync_inventory
from kvstore.master.warmup import Warmup
from kvstore.shardmap import ShardMap
from kvstore.types import EventKind, NodeAddress, NodeEvent, TierKind

T0 = 1_000_000
TTL_MS = 3000


def message(rows, **header) -> pb.SyncInventoryRequest:
    return pb.SyncInventoryRequest(
        items=[pb.InventoryItem(key=k, object_id=o, size_bytes=s, checksum=c, tier=t,
                                pending=p, replica_num=r) for k, o, s, c, t, p, r in rows],
        **header)


def hexkey(i: int) -> str:
    return xxhash.xxh3_128_hexdigest(i.to_bytes(8, "little"))


def test_encoded_bytes_are_protobufs_and_decode_back():
    rng = random.Random(1)
    rows = [(rng.choice([hexkey(i), "k", "é" * 3, "", "x" * 600]), rng.randrange(1, 2**63),
             rng.choice([0, 64, 2**64 - 1]), rng.randrange(2**64), rng.randrange(4),
             rng.random() < 0.3, rng.randrange(17)) for i in range(300)]
    for header in (dict(), dict(node_id="n0", incarnation="inc", sync_id=2**64 - 1, seq=7,
                                last=True)):
        raw = _native.encode_inventory(header.get("node_id", ""), header.get("incarnation", ""),
                                       header.get("sync_id", 0), header.get("seq", 0),
                                       header.get("last", False), rows)
        assert raw == message(rows, **header).SerializeToString()
        chunk = decode_sync_inventory(raw)
        assert (chunk.node_id, chunk.incarnation, chunk.sync_id, chunk.seq, chunk.last) == (
            header.get("node_id", ""), header.get("incarnation", ""), header.get("sync_id", 0),
            header.get("seq", 0), header.get("last", False))
        assert len(chunk) == chunk.stored() == len(rows)
        assert [chunk.item(i) for i in range(len(rows))] == rows


def test_decoding_agrees_with_protobuf_on_odd_and_broken_bytes():
    rows = [(hexkey(i), i + 1, 64, 99, 2, i % 2 == 0, 1) for i in range(5)]
    raw = message(rows, node_id="n0", sync_id=3, seq=1, last=True).SerializeToString()
    # Unknown fields, repeated scalars (the last wins), and a field of another wire type.
    extra = raw + b"\x38\x05" + b"\x20\x09" + b"\x1a\x01x" + b"\x7a\x00"
    ref = pb.SyncInventoryRequest.FromString(extra)
    chunk = decode_sync_inventory(extra)
    assert (chunk.seq, chunk.sync_id, len(chunk)) == (ref.seq, ref.sync_id, len(ref.items))
    for cut in range(len(raw)):
        try:
            pb.SyncInventoryRequest.FromString(raw[:cut])
            parsed = True
        except Exception:
            parsed = False
        try:
            decode_sync_inventory(raw[:cut])
            decoded = True
        except ValueError:
            decoded = False
        if not parsed:
            assert not decoded, cut           # never accept what protobuf refuses
    bad_utf8 = message([]).SerializeToString() + b"\x2a\x04\x0a\x02\xc3\x28"
    with pytest.raises(ValueError):
        decode_sync_inventory(bad_utf8)
    with pytest.raises(ValueError):
        decode_sync_inventory(b"\x2a\xff\xff\xff\xff\x0f")      # a length past the end
    with pytest.raises(ValueError):
        decode_sync_inventory(b"\x0b")                          # a group: not kvstore's


def test_random_bytes_never_crash_the_decoder():
    rng = random.Random(7)
    seed = message([(hexkey(i), i + 1, 64, 9, 2, False, 1) for i in range(20)],
                   node_id="n0").SerializeToString()
    for _ in range(3000):
        b = bytearray(seed)
        for _ in range(rng.randrange(1, 6)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        try:
            c = decode_sync_inventory(bytes(b))
        except ValueError:
            continue
        for i in range(c.stored()):
            c.item(i)


def test_items_past_the_chunk_limit_are_counted_not_kept():
    rows = [(hexkey(i), i + 1, 64, 9, 2, False, 1) for i in range(MAX_INVENTORY_CHUNK + 3)]
    chunk = decode_sync_inventory(_native.encode_inventory("n0", "", 1, 0, True, rows))
    assert len(chunk) == MAX_INVENTORY_CHUNK + 3 and chunk.stored() == MAX_INVENTORY_CHUNK


# ---- the native apply against the Python rules ----

def registration(node_id: str) -> NodeRegistration:
    return NodeRegistration(NodeAddress(node_id, "127.0.0.1", 1000), 1 << 30, 1 << 30,
                            incarnation="i")


class _Warmup(Warmup):
    def __init__(self):
        super().__init__(set(), T0, TTL_MS)


def build(seed: int, shard_map: ShardMap, max_objects: int):
    """An index of shard 0 holding a random past: entries on n0, n1, n2 (n2 dead),
    superseded notes and drops ordered to n0."""
    rng = random.Random(seed)
    m = Membership(node_ttl_ms=TTL_MS)
    for n in ("n0", "n1", "n2"):
        m.register(registration(n), T0)
    idx = ObjectIndex(m, shard_map, max_objects=max_objects)
    pool = [hexkey(i) for i in range(40 if seed % 2 else 400)] + ["plain-key", "Z" * 32]
    mine = [k for k in pool if idx.shard_map.shard_for_key(k).shard_id == 0]
    for key in rng.sample(mine, len(mine) // 2):
        grant, _ = idx.grant(rng.randrange(1, 3), 1, T0)
        for node in rng.sample(["n0", "n1", "n2"], rng.randrange(1, 4)):
            idx.node_event(node, NodeEvent(EventKind.STORED, key, grant.first_object_id,
                                           rng.choice([TierKind.DRAM, TierKind.SSD]), 64, 7),
                           T0)
    notes = 3 if seed % 4 == 0 else 0           # notes make the native apply defer
    for key in rng.sample(pool, notes):
        idx.superseded.note(key, rng.randrange(1, 60), T0)
    for key in rng.sample(pool, notes):
        m.order_drop("n0", key, rng.randrange(1, 60))
    m.nodes["n2"].alive = False
    return idx, pool


def inventory(seed: int, pool: list[str], idx: ObjectIndex) -> list[tuple]:
    """Random items of ``pool``'s keys; half of those indexed name the indexed version."""
    rng = random.Random(seed + 1000)
    rows = []
    for _ in range(rng.randrange(0, 300)):
        key = rng.choice(pool)
        entry = idx.entries.get(key)
        object_id = (entry.object_id if entry is not None and rng.random() < 0.5
                     else rng.randrange(1, 70))
        rows.append((key, object_id, rng.choice([64, 65]), rng.choice([7, 8]), rng.randrange(4),
                     rng.random() < 0.2, rng.randrange(4)))
    return rows


def snapshot(idx: ObjectIndex) -> dict:
    e = {k: (v.object_id, v.size_bytes, v.checksum, v.replica_num, tuple(v.replicas),
             tuple(sorted((n, int(t)) for n, t in v.tiers.items())))
         for k, v in idx.entries.items()}
    drops = {n: sorted((d.key, d.object_id) for d in info.drops)
             for n, info in idx.membership.nodes.items()}
    idx.table.check()
    return dict(entries=e, drops=drops, counters=dict(idx.counters), next_id=idx._next_id,
                bytes=idx.complete_bytes, superseded=dict(idx.superseded._newest),
                alive={n: (i.alive, i.syncing) for n, i in idx.membership.nodes.items()})


def sync(idx: ObjectIndex, rows: list[tuple], chunk_size: int, native: bool) -> list:
    async def main():
        regs = Registrations(idx, _Warmup(), Roster())
        sync_id = await regs.register(registration("n0"), T0 + 1)
        answers = []
        chunks = [rows[i:i + chunk_size] for i in range(0, len(rows), chunk_size)] or [[]]
        for seq, part in enumerate(chunks):
            last = seq == len(chunks) - 1
            raw = message(part, node_id="n0", sync_id=sync_id, seq=seq,
                          last=last).SerializeToString()
            items = (decode_sync_inventory(raw) if native
                     else pb.SyncInventoryRequest.FromString(raw).items)
            answers.append(await regs.sync_chunk("n0", sync_id, seq, items, last,
                                                 lambda: T0 + 2, wire.inventory_item))
        return answers
    return asyncio.run(main())


@pytest.mark.parametrize("seed", range(60))
def test_a_native_apply_leaves_the_index_as_the_python_rules_do(seed, monkeypatch):
    rng = random.Random(seed)
    if seed % 2:                                 # chunks applied in several slices
        monkeypatch.setattr(registration_module, "NATIVE_SLICE", rng.choice([1, 5, 33]))
    shard_map = (ShardMap.single("m:1") if seed % 3 else
                 ShardMap.even([("m:1",), ("m:2",)]))
    max_objects = rng.choice([2**63 - 1, 10])
    chunk_size = rng.choice([1, 7, 50, 500])
    python, pool = build(seed, shard_map, max_objects)
    native, _ = build(seed, shard_map, max_objects)
    assert snapshot(python) == snapshot(native)
    rows = inventory(seed, pool, python)
    if seed % 5 == 0:
        rows += rows[: len(rows) // 3]           # keys listed twice (a re-slotted object)
    assert sync(python, rows, chunk_size, False) == sync(native, rows, chunk_size, True)
    assert snapshot(python) == snapshot(native)


def test_a_bad_item_refuses_the_chunk_natively_as_in_python():
    for bad in [(hexkey(1), 0, 64, 7, 2, False, 1), (hexkey(1), 2**63, 64, 7, 2, False, 1),
                (hexkey(1), 5, 64, 7, 2, False, 17), (hexkey(1), 5, 64, 7, 9, False, 1)]:
        rows = [(hexkey(2), 3, 64, 7, 2, False, 1), bad]
        errors = []
        for native in (False, True):
            idx, _ = build(0, ShardMap.single("m:1"), 2**63 - 1)
            before = snapshot(idx)
            with pytest.raises(InvalidArgument) as err:
                sync(idx, rows, 10, native)
            errors.append(str(err.value))
            after = snapshot(idx)
            assert after["entries"] == before["entries"]          # nothing applied
        assert errors[0] == errors[1]


# ---- the node's side: chunks serialized and sent two at a time ----

class _Future:
    def __init__(self, answer):
        self.answer = answer

    def result(self):
        return self.answer

    def cancel(self):
        pass


class _Call:
    """SyncInventory as a master answers it: in order, known until ``forget_at``."""

    def __init__(self, forget_at: int = -1):
        self.chunks, self.forget_at = [], forget_at

    def future(self, raw, timeout):
        c = decode_sync_inventory(raw)
        self.chunks.append(c)
        known = c.seq != self.forget_at
        return _Future(pb.SyncInventoryResponse(known=known, items_applied=0))


def test_a_node_sends_its_chunks_in_order_the_last_marked():
    from kvstore.store.inventory import send_inventory
    rows = [(hexkey(i), i + 1, 64, 7, 2, False, 1) for i in range(10)]
    call = _Call()
    sent, items = send_inventory(call, "n0", "inc", 9, iter([rows[:3], rows[3:], []]), 4, 1.0)
    assert sent is not None and items == 10
    assert [(c.seq, c.last, len(c), c.sync_id, c.node_id) for c in call.chunks] == [
        (0, False, 4, 9, "n0"), (1, False, 4, 9, "n0"), (2, True, 2, 9, "n0")]
    assert [c.item(i)[0] for c in call.chunks for i in range(len(c))] == [r[0] for r in rows]
    empty = _Call()
    assert send_inventory(empty, "n0", "inc", 9, iter([]), 4, 1.0)[1] == 0
    assert [(c.seq, c.last, len(c)) for c in empty.chunks] == [(0, True, 0)]
    lost = _Call(forget_at=1)
    assert send_inventory(lost, "n0", "inc", 9, iter([rows]), 4, 1.0)[0] is None
