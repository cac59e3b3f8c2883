"""A master shard's server: the gRPC service, its maintenance loop, leader election.

Run as ``kvstore master`` (:mod:`kvstore.tools.cli.services` parses the options into a
:class:`MasterConfig`)::

    kvstore master                                     one shard owning every slot
    kvstore master --shard-id 1 --shard-map a,b        shard 1 of a static map (slots split evenly)
    kvstore master --shard-id 0 --shard-map "a|a2,b|b2" --port P --etcd URL
                                                       leader or standby of shard 0 (etcd lease)
"""

from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass
import logging

import grpc

from kvstore import rpc
from kvstore.binding import advertised_host, check_binding
from kvstore.clock import SYSTEM_CLOCK, Clock
from kvstore.health import Health, State, drain
from kvstore.metrics import MetricsConfig, ProcessMetrics, check_metrics_binding, start_metrics
from kvstore.rpc import ServerSecurity
from kvstore.master import metrics as master_metrics
from kvstore.master.event_feed import DEFAULT_CAPACITY
from kvstore.master.index import ObjectIndex
from kvstore.master.limits import default_max_objects
from kvstore.master.membership import Membership
from kvstore.master.quota_source import QuotaSources
from kvstore.master.roster import EtcdRoster, FileRoster, Roster
from kvstore.master.report_port import ReportPort
from kvstore.master.servicer import METHOD_ROLES, MasterServicer, add_to_server
from kvstore.process import (announce_ready, freeze_survivors, memory_limit_bytes,
                             wait_for_stop_signal)
from kvstore.shardmap import ShardMap

log = logging.getLogger(__name__)


async def create_server(host: str = "127.0.0.1", port: int = 0, *,
                        node_ttl_ms: int = 3000, heartbeat_interval_ms: int = 500,
                        node_forget_ms: int = 600_000,
                        put_timeout_ms: int = 30_000,
                        max_objects: int = 2**63 - 1,
                        shard_map: ShardMap | None = None,
                        shard_id: int = 0, election=None,
                        security: ServerSecurity | None = None, advertise_host: str = "",
                        metrics: ProcessMetrics | None = None,
                        health: Health | None = None, roster: Roster | None = None,
                        report_port: int = 0, event_log: int = DEFAULT_CAPACITY,
                        clock: Clock = SYSTEM_CLOCK) -> tuple[grpc.aio.Server, int, ObjectIndex]:
    """Build and start a master shard on ``host:port`` (0 = a free port).

    Without ``shard_map`` it is the only shard (every slot), named by its
    advertised address; with one, it owns the slots of range ``shard_id`` and
    answers WRONG_SHARD for the rest.

    Args:
        security: tokens (every call checked against :data:`METHOD_ROLES`) and TLS.
        advertise_host: the address clients reach it by (see kvstore.binding).
        put_timeout_ms: how long past a placement grant's validity a put of its
            ids may still report STORED (:mod:`kvstore.master.grants`).
        max_objects: objects the shard indexes at most (a new key beyond: NoSpace;
            see :mod:`kvstore.master.limits`).
        metrics: count and time every call, and export the shard's figures.
        health: serve the gRPC health service (SERVING while leading with a whole index).
        roster: where the shard keeps its nodes (:mod:`kvstore.master.roster`; None:
            nowhere, so each term's warm-up waits the node ttl).
        report_port: the report link's port on ``host`` (0: a free one).
        event_log: events the shard's event log keeps for replay
            (:mod:`kvstore.master.event_feed`).
        clock: the shard's clocks (:mod:`kvstore.clock`; tests step its wall clock).

    Returns:
        ``(server, port, index)``; stop with ``await server.stop(grace)``.

    Raises:
        OSError: the address cannot be bound.
    """
    server = rpc.aio_server(security, METHOD_ROLES, metrics)
    bound = rpc.listen(server, host, port, security)
    membership = Membership(node_ttl_ms=node_ttl_ms, heartbeat_interval_ms=heartbeat_interval_ms,
                            forget_ms=node_forget_ms)
    if shard_map is None:
        shard_map = ShardMap.single(f"{advertised_host(host, advertise_host)}:{bound}")
    index = ObjectIndex(membership, shard_map, shard_id=shard_id, put_timeout_ms=put_timeout_ms,
                        max_objects=max_objects)
    # Tenants' quotas (the --auth file's tenant lines; kvstore.master.tenant_book): each
    # term's index starts with the file's, and a reload (SIGHUP) replaces them.
    tokens = security.tokens if security is not None else None
    sources = QuotaSources(tokens.quotas if tokens is not None else {},
                           lambda quotas: servicer.index.tenants.set_quotas(quotas))
    index.tenants.set_quotas(sources.effective())

    def new_index() -> ObjectIndex:
        fresh = ObjectIndex(Membership(node_ttl_ms=node_ttl_ms,
                                       heartbeat_interval_ms=heartbeat_interval_ms,
                                       forget_ms=node_forget_ms),
                            shard_map, shard_id=shard_id, put_timeout_ms=put_timeout_ms,
                            max_objects=max_objects)
        fresh.tenants.set_quotas(sources.effective())
        return fresh
    servicer = MasterServicer(index, election=election, new_index=new_index, roster=roster,
                              security=security, clock=clock, event_log=event_log)
    if tokens is not None:
        tokens.on_reload.append(lambda table: sources.file_reloaded(table.quotas))
    servicer.quota_sources = sources     # etcd's quotas join in serve() (with --etcd)
    add_to_server(servicer, server)
    server.servicer = servicer      # for the maintenance loop and tests
    if health is not None:
        health.attach_grpc(server)
    if metrics is not None:
        master_metrics.register(metrics, servicer, asyncio.get_running_loop())
    await server.start()
    # The report link (kvstore.master.report_port) on the same host; serve() closes it.
    server.report_port = ReportPort(servicer, security, metrics)
    servicer.report_port = await server.report_port.start(host, report_port)
    return server, bound, index


async def _maintenance(servicer: MasterServicer, period_s: float,
                       health: Health | None = None) -> None:
    """Expire dead nodes and old placement grants, forget nodes dead for long, and plan
    repair copies, every ``period_s``; keep ``health`` SERVING while leading with a
    whole index (:mod:`kvstore.master.warmup`), STANDBY otherwise. The scans of
    every entry run a slice at a time (:func:`_sliced`): other calls go on meanwhile."""
    while True:
        await asyncio.sleep(period_s)
        freeze_survivors()        # the index's entries out of the cyclic GC's full scans
        await maintain(servicer, health)


async def maintain(servicer: MasterServicer, health: Health | None = None) -> None:
    """One round of :func:`_maintenance`, at the servicer's clock's monotonic time."""
    leading = servicer.leading()
    if leading:
        await servicer.term.load_roster()
    warming = _show_health(servicer, health, leading)
    if not leading:
        return
    now = servicer.clock.monotonic_ms()
    index, term = servicer.index, servicer.term
    index.membership.expire(now)
    term.registrations.expire()
    gone = index.forget_nodes(now)
    await _sliced(index.forget_steps())
    await term.forget_in_roster(gone, now)
    await term.reserve_ids()
    index.expire_grants(now)
    if not warming:
        await _sliced(servicer.repairs.plan_steps(now))


def _show_health(servicer: MasterServicer, health: Health | None, leading: bool) -> bool:
    """SERVING while leading with a whole index, STANDBY (saying why) otherwise;
    returns whether the index is warming up."""
    warming = servicer.warming_up()
    if health is not None:
        e = servicer.election
        if leading and not warming:
            health.set(State.SERVING)
        elif e is not None and not leading and not e.etcd_reachable():
            health.set(State.STARTING)     # cannot reach etcd: could never take over
        else:
            health.set(State.STANDBY)
        health.detail = servicer.term.describe(servicer.clock.monotonic_ms()) if leading and warming else ""
    return warming


async def _sliced(steps) -> None:
    """Run a scan that yields between slices, letting the event loop serve in between."""
    for _ in steps:
        await asyncio.sleep(0)


@dataclass(frozen=True, slots=True)
class MasterConfig:
    """What one master process serves."""

    host: str = "127.0.0.1"            # bind address (loopback by default)
    port: int = 0                      # 0: a free port (or this shard's in shard_map)
    report_port: int = 0               # the report link's port (report_port.py); 0: a free one
    node_ttl_ms: int = 3000            # a node without heartbeats this long is dead
    node_forget_ms: int = 600_000      # ... this long: removed, with its replicas
    shard_map: ShardMap | None = None  # None: the only shard, owning every slot
    shard_id: int = 0                  # this master's shard in shard_map
    etcd: str = ""                     # etcd URL: elect the shard's leader through a lease
    cluster_name: str = "default"      # etcd key name space
    lease_ttl_s: int = 3               # leader lease ttl
    state_dir: str = ""                # keep the shard's roster here (without etcd)
    max_objects: int = 0               # objects indexed at most (0: limits.default_max_objects)
    security: ServerSecurity = ServerSecurity()   # --auth, --tls-*
    insecure: bool = False             # allow a non-loopback bind without --auth (warned)
    advertise_host: str = ""           # address to give others ("" : see kvstore.binding)
    metrics: MetricsConfig = MetricsConfig()   # --metrics-port, --metrics-host
    drain_s: float = 0.0               # SIGTERM: NOT_SERVING this long before stopping
    event_log: int = DEFAULT_CAPACITY  # events kept for WatchEvents replay (event_feed.py)


async def serve(cfg: MasterConfig) -> None:
    """Serve until SIGTERM / SIGINT (announces READY once listening).

    Raises:
        SystemExit: the shard map does not name this shard, or names several
            addresses for it and no ``port`` says which one is this process.
    """
    check_binding("master", cfg.host, cfg.security.tokens is not None, cfg.insecure)
    check_metrics_binding("master", cfg.metrics, cfg.host, cfg.security.tokens is not None,
                          cfg.insecure)
    port = cfg.port
    if cfg.shard_map is not None:
        mine = next((r for r in cfg.shard_map.ranges if r.shard_id == cfg.shard_id), None)
        if mine is None:
            raise SystemExit(f"kvstore master: shard {cfg.shard_id} is not in the shard map")
        if not port:
            addrs = mine.addresses
            if len(addrs) > 1:
                raise SystemExit("kvstore master: the shard has several addresses; pick one "
                                 "with --port")
            port = int(addrs[0].rsplit(":", 1)[1])
    election = None
    roster = FileRoster(cfg.state_dir) if cfg.state_dir else Roster()
    if cfg.etcd:
        from kvstore.master.election import Election
        election = Election(cfg.etcd, cfg.cluster_name, cfg.shard_id,
                            f"{advertised_host(cfg.host, cfg.advertise_host)}:{port}",
                            ttl_s=cfg.lease_ttl_s)
        roster = EtcdRoster(election.etcd, cfg.cluster_name, cfg.shard_id)
    try:
        roster.load()             # a roster that cannot be read stops the start here
    except OSError as exc:
        if not cfg.etcd:
            raise SystemExit(f"kvstore master: --state-dir {cfg.state_dir}: {exc}") from None
        log.warning("the shard's roster in etcd cannot be read yet: %s", exc)
    metrics = ProcessMetrics("master")
    health = Health(("kvstore.v1.Master",))
    server, bound, index = await create_server(cfg.host, port, node_ttl_ms=cfg.node_ttl_ms,
                                               node_forget_ms=cfg.node_forget_ms,
                                               max_objects=cfg.max_objects or
                                               default_max_objects(memory_limit_bytes()),
                                               shard_map=cfg.shard_map, shard_id=cfg.shard_id,
                                               election=election, security=cfg.security,
                                               advertise_host=cfg.advertise_host,
                                               metrics=metrics, health=health, roster=roster,
                                               report_port=cfg.report_port,
                                               event_log=cfg.event_log)
    host = advertised_host(cfg.host, cfg.advertise_host)
    address = f"{host}:{bound}"
    try:
        mserver, maddress = start_metrics(cfg.metrics, cfg.host, metrics, health, cfg.security,
                                          host)
    except OSError:
        server.report_port.close()    # stopped on this loop: no grpc teardown noise at exit
        await server.stop(None)
        raise
    server.servicer.metrics_address = maddress
    await server.servicer.term.load_roster()     # a fresh cluster (empty roster) serves at once
    _show_health(server.servicer, health, server.servicer.leading())
    if election is not None:
        election.address = address
        election.start()
    task = asyncio.create_task(_maintenance(server.servicer, 0.2, health))
    quotas = (asyncio.create_task(server.servicer.quota_sources.follow_etcd(
        election.etcd, cfg.cluster_name)) if election is not None else None)
    watch = asyncio.create_task(server.servicer.loop_watch.run())
    if cfg.security.tokens is not None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, cfg.security.tokens.reload)
    info = {"role": "master", "address": address, "port": bound, "shard_id": cfg.shard_id,
            "report_port": server.servicer.report_port}
    if maddress:
        info["metrics_address"] = maddress
    announce_ready(info)
    await wait_for_stop_signal()
    # Drain: NOT_SERVING first, then stop accepting, then the calls in flight end;
    # only then give up the lead (a standby takes over after the lease). Event
    # watches never end by themselves: they end first.
    server.servicer.end_watches()
    await drain(health, server, cfg.drain_s)
    server.report_port.close()
    task.cancel()
    watch.cancel()
    if quotas is not None:
        quotas.cancel()
    if election is not None:
        election.stop()
    if mserver is not None:
        mserver.stop()
    log.info("master stopped")
