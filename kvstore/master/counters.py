"""What a master shard counts (``kvctl stats``, ``KVClient.stat``'s ``counters``)."""

from __future__ import annotations

import enum


class MasterCounter(str, enum.Enum):
    """One shard's counters, since its term began; valued as their names on the wire."""

    GRANTS = "grants"                            # placement grants issued (GrantPlacement)
    PUTS = "puts"                                # puts made visible (their first STORED)
    PUTS_ALREADY_PRESENT = "puts_already_present"   # second puts of equal bytes
    STORED_REFUSED = "stored_refused"            # STORED reports of no known put (dropped)
    LINK_REPORTS = "link_reports"                # node reports on the report link
    LINKS_REFUSED = "links_refused"              # report links closed on a bad frame or proof
    PORT_CALLS = "port_calls"                    # clients' calls on the socket port (call_port.py)
    LOOKUP_HITS = "lookup_hits"
    LOOKUP_MISSES = "lookup_misses"
    EXISTS_KEYS = "exists_keys"                  # keys asked about by Exists
    REMOVES = "removes"                          # objects removed by clients
    EVICTS = "evicts"                            # ... evicted by an operator (kvctl evict)
    REPLICAS_EVICTED = "replicas_evicted"        # EVICTED events applied
    REPLICAS_DEMOTED = "replicas_demoted"        # DEMOTED events applied
    REPLICAS_PROMOTED = "replicas_promoted"      # PROMOTED events applied
    STALE_REPLICAS_DROPPED = "stale_replicas_dropped"  # replaced versions in an inventory
    REINDEXED = "reindexed"                      # objects learnt from inventories
    REPAIRS_ORDERED = "repairs_ordered"          # re-replication copies ordered
    REPAIRS = "repairs"                          # ... that added a replica (its STORED)
    REPAIR_FAILURES = "repair_failures"          # ... that the node reported failed
    REPAIR_TIMEOUTS = "repair_timeouts"          # ... given up unanswered
    TRANSFER_FAILURES_REPORTED = "transfer_failures_reported"  # ReportFailure node ids
    QUARANTINED = "quarantined"                  # nodes quarantined by those reports
    FORGOTTEN = "forgotten"                      # objects deleted with the last node holding them
    PUTS_OVER_LIMIT = "puts_over_limit"          # new keys refused NO_SPACE at --max-objects
    INVENTORY_OVER_LIMIT = "inventory_over_limit"   # objects indexed from inventories past it
