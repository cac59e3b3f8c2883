"""What INFO and CONFIG GET answer: Redis' fields, filled from the store's stats.

INFO sections (``INFO``, ``INFO all`` or ``INFO <section>...``)::

    server    redis_version (the RESP surface's), kvstore_version, tcp_port, uptime
    clients   connected_clients, maxclients
    memory    used_memory / maxmemory: the store nodes' DRAM tiers, summed (bytes);
              maxmemory_policy: the nodes' eviction, which is the store's own
    stats     commands processed, keyspace_hits / keyspace_misses (this front's GETs)
    keyspace  db0:keys=N (objects over every shard)
    kvstore   shards, nodes, per-tier capacity and use, the front's hit rate, and
              each shard's own counters summed (puts, lookups, removes, ...)

Thread safety: read-only over the front's counters and fresh store stats.
"""

from __future__ import annotations

import os
import platform
import time
from collections import defaultdict

from kvstore.errors import PermissionDenied

#: The version redis-cli and client libraries see (HELLO, INFO): the RESP
#: surface follows Redis 7.0's.
REDIS_VERSION = "7.0.0"
SECTIONS = ("server", "clients", "memory", "stats", "keyspace", "kvstore")


def _human(size_bytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if size_bytes >= scale:
            return f"{size_bytes / scale:.2f}{unit}"
    return f"{size_bytes}B"


_NEEDS_STORE = frozenset({"memory", "stats", "keyspace", "kvstore"})


def _store_facts(front) -> dict:
    """Shards, nodes and tiers from one round of Stat calls."""
    shards = front.kv.stat()
    nodes = {n.address.node_id: n for st in shards for n in st.nodes if n.alive}
    tiers: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])   # capacity, used, objects
    for n in nodes.values():
        for t in n.tiers:
            acc = tiers[t.kind.name.lower()]
            acc[0] += t.capacity_bytes
            acc[1] += t.used_bytes
            acc[2] += t.num_objects
    counters: dict[str, int] = defaultdict(int)
    for st in shards:
        for k, v in st.counters.items():
            counters[k] += v
    return {"shards": shards, "nodes": nodes, "tiers": dict(tiers), "counters": dict(counters),
            "objects": sum(st.num_objects for st in shards)}


def info_text(front, sections: list[str], store_wide: bool = True) -> str:
    """The INFO reply for ``sections`` (empty, "all", "default", "everything": all);
    without ``store_wide`` (a connection of some tenants only) the sections of
    store-wide figures say they are hidden.

    Raises:
        KVStoreError: the store cannot be asked (Unavailable, PermissionDenied).
    """
    wanted = [s for s in SECTIONS if not sections or s in sections
              or {"all", "default", "everything"} & set(sections)]
    facts: dict | None = {}
    if not store_wide:
        facts = None
    elif _NEEDS_STORE & set(wanted):
        try:
            facts = _store_facts(front)
        except PermissionDenied:
            facts = None          # the front's own token may not read the shards' stats
    lines: list[str] = []
    for name in wanted:
        lines.append(f"# {name.capitalize() if name != 'kvstore' else 'kvstore'}")
        if facts is None and name in _NEEDS_STORE:
            lines.append("store_stats:hidden (store-wide figures are an admin's; this "
                         "connection acts for some tenants only)" if not store_wide else
                         "store_stats:unavailable (the front's store token is not an admin "
                         "one; the shards' Stat needs admin)")
        else:
            lines += [f"{k}:{v}" for k, v in _SECTION[name](front, facts).items()]
        lines.append("")
    return "\r\n".join(lines)


def _server(front, facts) -> dict:
    return {"redis_version": REDIS_VERSION, "redis_mode": "standalone",
            "kvstore_version": front.version, "server_name": "kvstore-resp",
            "os": f"{platform.system()} {platform.release()} {platform.machine()}",
            "arch_bits": 64, "process_id": os.getpid(), "tcp_port": front.port,
            "uptime_in_seconds": int(time.monotonic() - front.started_s),
            "master": front.master}


def _clients(front, facts) -> dict:
    return {"connected_clients": front.stats.connections, "maxclients": front.max_clients}


def _memory(front, facts) -> dict:
    dram = facts["tiers"].get("dram", [0, 0, 0])
    return {"used_memory": dram[1], "used_memory_human": _human(dram[1]),
            "maxmemory": dram[0], "maxmemory_human": _human(dram[0]),
            "maxmemory_policy": front.eviction_policy(),
            "eviction": "the store's own (each node's tiers and policy); the front keeps no data"}


def _stats(front, facts) -> dict:
    s = front.stats
    return {"total_connections_received": s.accepted, "total_commands_processed": s.commands,
            "rejected_connections": s.rejected, "keyspace_hits": s.hits,
            "keyspace_misses": s.misses, "expired_keys": 0,
            # replicas the nodes gave up for room (EVICTED events the shards applied)
            "evicted_keys": facts["counters"].get("replicas_evicted", 0)}


def _keyspace(front, facts) -> dict:
    return {"db0": f"keys={facts['objects']},expires=0,avg_ttl=0"} if facts["objects"] else {}


def _kvstore(front, facts) -> dict:
    s = front.stats
    reads = s.hits + s.misses
    out = {"shards": len(facts["shards"]), "nodes": len(facts["nodes"]),
           "objects": facts["objects"],
           "hit_rate": f"{s.hits / reads:.4f}" if reads else "0.0000"}
    for kind, (cap, used, objs) in sorted(facts["tiers"].items()):
        out[f"tier_{kind}"] = f"capacity={cap},used={used},objects={objs}"
    for k, v in sorted(facts["counters"].items()):
        out[f"master_{k}"] = v
    return out


_SECTION = {"server": _server, "clients": _clients, "memory": _memory, "stats": _stats,
            "keyspace": _keyspace, "kvstore": _kvstore}


def config_values(front) -> dict[str, str]:
    """The (read-only) configuration CONFIG GET reports, in Redis' names.

    Raises:
        KVStoreError: the store cannot be asked (Unavailable, PermissionDenied).
    """
    nodes = _store_facts(front)["nodes"]
    return {"save": "", "appendonly": "no", "databases": "1",
            "maxclients": str(front.max_clients),
            "maxmemory": str(sum(n.capacity_bytes for n in nodes.values())),
            "maxmemory-policy": front.eviction_policy(),
            "proto-max-bulk-len": str(front.limits.max_bulk_bytes),
            "port": str(front.port), "bind": front.host, "timeout": "0"}
