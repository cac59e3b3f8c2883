"""A master shard's metrics (``--metrics-port``; names in kvstore.metrics' conventions).

    kvstore_requests_total{op,code}, kvstore_request_duration_seconds{op}   every gRPC call
                                          and every client call on the socket port
    kvstore_master_is_leader              1 while this process serves its shard
    kvstore_leader_changes_total          times this process won or lost its shard's lead
    kvstore_objects, kvstore_object_bytes objects readable now (a live replica), and their bytes
    kvstore_objects_unavailable           objects whose every replica is on a dead node
    kvstore_nodes{state}                  registered nodes: alive, quarantined, dead
    kvstore_repairs_total                 repair copies that added a replica
    kvstore_lookup_keys_total{result}     keys looked up: hit, miss (the shard's hit rate)
    kvstore_master_events_total{event}    every counter of kvstore.master.counters
    kvstore_event_loop_stall_max_seconds  the event loop's longest stall (kvstore.master.stall)
    kvstore_event_loop_stalls_total       ... and its stalls of 50 ms or more
    kvstore_tenant_objects{tenant}, kvstore_tenant_bytes{tenant}   each tenant's objects
                                          on the shard and their bytes (each object once)
    kvstore_tenant_limit_bytes{tenant}, kvstore_tenant_limit_objects{tenant}  the shard's
                                          part of its hard limits (tenants with one)
    kvstore_tenant_{puts,hits,misses,evictions,refusals}_total{tenant}   this term's counts
                                          (kvstore.master.tenant_book)

Counters add the earlier terms' counts (a new term starts a fresh index), so
they never go down while the process lives. The figures are read on the
server's event loop (the index has no lock), at scrape time.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from kvstore.master.counters import MasterCounter as C
from kvstore.master.servicer import MasterServicer
from kvstore.metrics import ProcessMetrics, counter, gauge

SCRAPE_TIMEOUT_S = 5.0


def snapshot(servicer: MasterServicer) -> list:
    """The shard's metric families now (call on the servicer's event loop)."""
    leading = servicer.leading()
    index = servicer.index
    counts = Counter(servicer.past_counters)
    counts.update(index.counters)
    now = servicer.clock.monotonic_ms()
    states = Counter()
    for info in index.membership.nodes.values():
        if not info.alive:
            states["dead"] += 1
        elif index.membership.is_quarantined(info.node_id, now):
            states["quarantined"] += 1
        else:
            states["alive"] += 1
    st = index.stat() if leading else None
    out = [
        gauge("kvstore_master_is_leader", "1 while this process serves its shard.",
              1 if leading else 0, {"shard": str(index.shard_id)}),
        counter("kvstore_leader_changes", "Times this process won or lost its shard's lead.",
                servicer.leader_changes),
        gauge("kvstore_objects", "Objects readable now (a replica on a live node).",
              st.num_objects if st else 0),
        gauge("kvstore_objects_unavailable", "Objects whose every replica is on a dead node "
              "(kept until --node-forget-ms).", st.unavailable_objects if st else 0),
        gauge("kvstore_object_bytes", "Bytes of the objects readable now (B).",
              st.total_bytes if st else 0),
        gauge("kvstore_nodes", "Registered store nodes by state.",
              samples=[({"state": s}, states[s]) for s in ("alive", "quarantined", "dead")]),
        counter("kvstore_repairs", "Repair copies that added a replica.", counts[C.REPAIRS]),
        counter("kvstore_lookup_keys", "Keys looked up, by result.",
                samples=[({"result": "hit"}, counts[C.LOOKUP_HITS]),
                         ({"result": "miss"}, counts[C.LOOKUP_MISSES])]),
        counter("kvstore_master_events", "The shard's counters (kvctl stats), all terms.",
                samples=[({"event": c.value}, counts[c]) for c in C]),
        gauge("kvstore_event_loop_stall_max_seconds",
              "The longest time the master's event loop was kept from serving (s).",
              servicer.loop_watch.max_ms / 1000),
        counter("kvstore_event_loop_stalls", "Stalls of the master's event loop of 50 ms "
                "or more.", servicer.loop_watch.stalls),
    ]
    if leading:
        out.extend(tenant_families(index))
    return out


def tenant_families(index) -> list:
    """The ``kvstore_tenant_*`` families of ``index``'s shard (every tenant: a metrics
    token sees the process's figures whole)."""
    figures = index.tenants.figures(index)
    out = [
        gauge("kvstore_tenant_objects", "A tenant's objects on the shard (each once).",
              samples=[({"tenant": t.tenant}, t.objects) for t in figures]),
        gauge("kvstore_tenant_bytes", "Bytes of a tenant's objects on the shard, each "
              "object once (B).", samples=[({"tenant": t.tenant}, t.bytes) for t in figures]),
        gauge("kvstore_tenant_limit_bytes", "The shard's part of a tenant's hard limit on "
              "bytes (B).", samples=[({"tenant": t.tenant}, t.max_bytes) for t in figures
                                     if t.max_bytes]),
        gauge("kvstore_tenant_limit_objects", "The shard's part of a tenant's hard limit on "
              "objects.", samples=[({"tenant": t.tenant}, t.max_objects) for t in figures
                                   if t.max_objects]),
    ]
    def per_tenant(name: str) -> list:
        return [({"tenant": t.tenant}, t.counters.get(name, 0)) for t in figures]
    # Literal names: the dashboard test (tests/integration/test_deploy.py) finds the
    # exported families by their names in the source.
    out += [
        counter("kvstore_tenant_puts", "New keys of a tenant made visible (this term).",
                samples=per_tenant("puts")),
        counter("kvstore_tenant_hits", "A tenant's keys looked up and found (this term).",
                samples=per_tenant("hits")),
        counter("kvstore_tenant_misses", "A tenant's keys looked up and not found (this "
                "term).", samples=per_tenant("misses")),
        counter("kvstore_tenant_evictions", "A tenant's objects gone with their last "
                "replica's eviction (this term).", samples=per_tenant("evictions")),
        counter("kvstore_tenant_refusals", "A tenant's puts refused NoSpace over a hard limit "
                "(this term).", samples=per_tenant("refusals")),
    ]
    return out


def register(metrics: ProcessMetrics, servicer: MasterServicer,
             loop: asyncio.AbstractEventLoop) -> None:
    """Add the shard's collector to ``metrics``; scrapes read it on ``loop``."""
    async def read():
        return snapshot(servicer)

    def collect():
        return asyncio.run_coroutine_threadsafe(read(), loop).result(SCRAPE_TIMEOUT_S)

    metrics.collect(collect)
