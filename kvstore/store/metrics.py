"""A store node's metrics (``--metrics-port``; names in kvstore.metrics' conventions).

    kvstore_requests_total{op,code}, kvstore_request_duration_seconds{op}
                                          every data-port request (op: put, get, shm_alloc, ...)
    kvstore_tier_capacity_bytes{tier}     per tier (DRAM, GPU, SSD): capacity,
    kvstore_tier_used_bytes{tier}         ... bytes in use (the node's own stats: kvctl stats),
    kvstore_tier_evictable_bytes{tier}    ... bytes that could be given up now,
    kvstore_tier_objects{tier}            ... objects with a copy there
    kvstore_evicted_objects_total{tier}   objects evicted to make room in that tier
    kvstore_demoted_objects_total         copies written to a slower tier
    kvstore_promoted_objects_total        copies brought up to DRAM
    kvstore_prefetch_total{outcome}       lookahead prefetches: started, used, wasted
    kvstore_transfer_bytes_total{transport,direction}   value bytes in / out, tcp and shm
    kvstore_connections{transport}        data connections open
    kvstore_node_objects                  complete objects held
    kvstore_recovery_dropped_objects_total{cause}   SSD records dropped at start: corrupt, surplus
    kvstore_stalled_connections_total{direction}    connections dropped for a stall: write
                                          (a value's bytes stopped coming), read (the reader
                                          took no byte of its replies in time)
    kvstore_node_events_total{event}      every counter of kvstore.store.stats
    kvstore_node_tenant_bytes{tenant}, kvstore_node_tenant_share_bytes{tenant}
                                          while some tenant has a guaranteed share: each
                                          tenant's bytes in service and its share (B;
                                          kvstore.store.tenant_shares)

Tier figures are counted at scrape time under the node's lock, the same way
``kvctl stats`` counts them, so the two agree.
"""

from __future__ import annotations

from kvstore.metrics import ProcessMetrics, counter, gauge
from kvstore.store.data_server import DataServer
from kvstore.store.node import StoreNode
from kvstore.store.stats import NodeCounter as N


def snapshot(node: StoreNode, server: DataServer) -> list:
    """The node's metric families now (any thread)."""
    st = node.stats()
    c = st.counters or {}
    tiers = [(t.kind.name, t) for t in st.tiers]
    evicted = [({"tier": lv.tier.kind.name}, lv.evictions) for lv in node.levels]
    traffic = server.traffic
    held = node.tenants.snapshot()
    return [
        gauge("kvstore_node_tenant_bytes", "A tenant's bytes in service on the node, while "
              "some tenant has a guaranteed share (B).",
              samples=[({"tenant": t}, b) for t, (b, _) in held.items()]),
        gauge("kvstore_node_tenant_share_bytes", "A tenant's guaranteed share of the node (B).",
              samples=[({"tenant": t}, s) for t, (_, s) in held.items() if s]),
        gauge("kvstore_tier_capacity_bytes", "Tier capacity (B).",
              samples=[({"tier": k}, t.capacity_bytes) for k, t in tiers]),
        gauge("kvstore_tier_used_bytes", "Tier bytes in use (B).",
              samples=[({"tier": k}, t.used_bytes) for k, t in tiers]),
        gauge("kvstore_tier_evictable_bytes", "Tier bytes that could be given up now (B).",
              samples=[({"tier": k}, t.evictable_bytes) for k, t in tiers]),
        gauge("kvstore_tier_objects", "Objects with a copy in the tier.",
              samples=[({"tier": k}, t.num_objects) for k, t in tiers]),
        counter("kvstore_evicted_objects", "Objects evicted to make room in a tier.",
                samples=evicted),
        counter("kvstore_demoted_objects", "Copies written to a slower tier.",
                c.get(N.DEMOTIONS.value, 0)),
        counter("kvstore_promoted_objects", "Copies brought up to DRAM.",
                c.get(N.PROMOTIONS.value, 0)),
        counter("kvstore_prefetch", "Lookahead prefetches by outcome.",
                samples=[({"outcome": "started"}, c.get(N.PREFETCHES.value, 0)),
                         ({"outcome": "used"}, c.get(N.PREFETCH_USED.value, 0)),
                         ({"outcome": "wasted"}, c.get(N.PREFETCH_WASTED.value, 0))]),
        counter("kvstore_transfer_bytes", "Value bytes moved, by transport and direction.",
                samples=[({"transport": t, "direction": d}, n)
                         for (t, d), n in sorted(traffic.bytes().items())]),
        gauge("kvstore_connections", "Data connections open, by transport.",
              samples=[({"transport": t}, n) for t, n in sorted(traffic.connections().items())]),
        gauge("kvstore_node_objects", "Complete objects held.", st.num_objects),
        counter("kvstore_recovery_dropped_objects", "SSD records dropped at start, by cause.",
                samples=[({"cause": "corrupt"}, c.get(N.RECOVERY_DROPPED_CORRUPT.value, 0)),
                         ({"cause": "surplus"}, c.get(N.RECOVERY_DROPPED_SURPLUS.value, 0))]),
        counter("kvstore_stalled_connections", "Data connections dropped for a stall.",
                samples=[({"direction": "write"}, c.get(N.STALLED_WRITES.value, 0)),
                         ({"direction": "read"}, c.get(N.STALLED_READS.value, 0))]),
        counter("kvstore_node_events", "The node's counters (kvctl stats).",
                samples=[({"event": n.value}, c.get(n.value, 0)) for n in N]),
    ]


def register(metrics: ProcessMetrics, node: StoreNode, server: DataServer) -> None:
    """Add the node's collector to ``metrics``."""
    metrics.collect(lambda: snapshot(node, server))
