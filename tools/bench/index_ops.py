"""µs per key of the master index's hot calls, on the pure index (no network).

    python -m kvstore.tools.bench.index_ops --keys 1000000

One shard, one registered node, ``--keys`` objects put the way nodes report
them (a grant, then one STORED event per key through ``node_event``); then
``lookup`` and ``exists`` of every key in batches of ``--batch``. Prints, per
call kind, µs per key (wall time of the whole pass over the keys, divided by
the keys) and the process's RSS growth per key. Keys are 32 hex characters
(xxh3-128 of the key's number), like a scale run's.

``--tenant NAME`` makes them tenant NAME's keys (``@NAME/<hex>``: counted by tenant,
docs/tenants.md); ``--quota`` gives the keys' tenant a hard limit no put reaches, so
every STORED also runs the limit check.
"""

from __future__ import annotations

import argparse
import gc
import time

import xxhash

from kvstore.master.index import ObjectIndex
from kvstore.master.membership import Membership, NodeRegistration
from kvstore.shardmap import ShardMap
from kvstore.tenants import Quota
from kvstore.types import EventKind, NodeAddress, NodeEvent, TierKind


def _rss_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--tenant", default="", help="keys of this tenant (@NAME/...)")
    ap.add_argument("--quota", action="store_true", help="a hard limit on the keys' tenant")
    args = ap.parse_args()
    n, batch = args.keys, args.batch
    membership = Membership(node_ttl_ms=3_600_000)
    membership.register(NodeRegistration(NodeAddress("n0", "127.0.0.1", 1000), 1 << 40,
                                         1 << 40), 0)
    index = ObjectIndex(membership, ShardMap.single("127.0.0.1:1"))
    head = f"@{args.tenant}/" if args.tenant else ""
    keys = [head + xxhash.xxh3_128_hexdigest(i.to_bytes(8, "little")) for i in range(n)]
    if args.quota:
        index.tenants.set_quotas({args.tenant or "default": Quota(max_bytes=1 << 62)})
    gc.collect()
    rss0 = _rss_bytes()
    grant, _ = index.grant(1, 65_536, 1)
    first = grant.first_object_id
    t = time.perf_counter()
    for i, key in enumerate(keys):
        if i and i % 65_536 == 0:
            grant, _ = index.grant(1, 65_536, 1)
            first = grant.first_object_id - i
        err = index.node_event("n0", NodeEvent(EventKind.STORED, key, first + i, TierKind.DRAM,
                                               64, i), 1)
        assert err is None, err
    stored_us = (time.perf_counter() - t) / n * 1e6
    gc.collect()
    rss = _rss_bytes() - rss0
    t = time.perf_counter()
    for s in range(0, n, batch):
        for r in index.lookup(keys[s:s + batch], 2):
            assert not isinstance(r, Exception), r
    lookup_us = (time.perf_counter() - t) / n * 1e6
    t = time.perf_counter()
    for s in range(0, n, batch):
        assert all(index.exists(keys[s:s + batch]))
    exists_us = (time.perf_counter() - t) / n * 1e6
    print(f"keys {n}  batch {batch}")
    print(f"STORED apply  {stored_us:7.2f} us/key")
    print(f"lookup        {lookup_us:7.2f} us/key")
    print(f"exists        {exists_us:7.2f} us/key")
    print(f"RSS growth    {rss / n:7.0f} B/key (keys' own strings excluded)")


if __name__ == "__main__":
    main()
