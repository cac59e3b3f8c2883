"""A kvstore cluster across hosts: the multi-host layout on
:class:`~kvstore.tools.cluster.netns.NetHosts`.

    host a   etcd (on a's loopback), shard 0: leader + standby, shard 1: leader + standby
    host b   store nodes b0, b1 (b0 bound to 0.0.0.0: it advertises b's address)
    host c   store node c0
    host d   prefill engine, decode engine, conductor (+ the HTTP front)
    host e   clients (nothing runs there; ``client_args`` runs a command there)

Processes talk only over the hosts' bridge (198.18.0.0/15), never loopback
(etcd excepted: only host a's masters use it). With ``secure`` (the
default) every server authenticates (``--auth``: admin, client and node
tokens) and serves TLS with mutual authentication (a throwaway CA from
:func:`~kvstore.tools.cluster.certs.make_certs`); nodes hold the node token, the
engines and the conductor a client token. :meth:`MultiHost.describe` is
the cluster as ``kvstore chaos --attach`` reads it.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import typer

from kvstore.tools.cluster.launcher import StoreCluster
from kvstore.tools.cluster.netns import NetHosts
from kvstore.tools.cluster.processes import Child, ChildFailed, ProcessGroup, service_args

HOSTS = ("a", "b", "c", "d", "e")
ETCD_PORT = 2379
MASTER_PORTS = ((7001, 7002), (7003, 7004))     # per shard: leader candidates on host a
ROLES = ("admin", "client", "node")


@dataclass(frozen=True, slots=True)
class Credentials:
    """The cluster's token file, its tokens by role and (with TLS) its certificates."""

    folder: Path
    auth_file: Path
    tokens: dict[str, str]
    tls: bool

    def server_args(self) -> list[str]:
        """What every server is started with."""
        args = ["--auth", str(self.auth_file)]
        if self.tls:
            f = self.folder
            args += ["--tls-cert", str(f / "server.pem"), "--tls-key", str(f / "server.key"),
                     "--tls-ca", str(f / "ca.pem")]
        return args

    def client_env(self, role: str | None) -> dict[str, str]:
        """A client's environment: its token (None: none) and TLS files."""
        env = {"KVSTORE_TOKEN": self.tokens[role]} if role else {}
        if self.tls:
            env.update(KVSTORE_TLS_CA=str(self.folder / "ca.pem"),
                       KVSTORE_TLS_CERT=str(self.folder / "client.pem"),
                       KVSTORE_TLS_KEY=str(self.folder / "client.key"))
        return env


def make_credentials(folder: str | os.PathLike, hosts: list[str], tls: bool = True) -> Credentials:
    """Fresh tokens (one per role) and, with ``tls``, a CA and certificates for ``hosts``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokens = {role: f"{role}-{secrets.token_hex(16)}" for role in ROLES}
    auth = folder / "tokens"
    auth.write_text("# role token\n" + "".join(f"{r} {t}\n" for r, t in tokens.items()))
    auth.chmod(0o600)
    if tls:
        from kvstore.tools.cluster.certs import make_certs

        make_certs(folder, hosts)
    return Credentials(folder, auth, tokens, tls)


@dataclass
class MultiHost:
    """The started layout (see the module docstring); :meth:`stop` ends it."""

    hosts: NetHosts
    creds: Credentials
    procs: ProcessGroup
    store: StoreCluster                       # masters (shards) and nodes, for chaos and tests
    engines: dict[str, Child] = field(default_factory=dict)
    conductor: Child | None = None
    etcd: subprocess.Popen | None = None

    @property
    def seed(self) -> str:
        """Clients' and nodes' ``--master``: shard 0's masters."""
        return self.store.master

    def client_args(self, argv: list[str]) -> list[str]:
        """``argv`` run on host e (prefix it to a ``subprocess`` call)."""
        return [*self.hosts.exec_args("e"), *argv]

    def run_client(self, argv: list[str], role: str | None = "client", timeout_s: float = 300,
                   env: dict | None = None) -> subprocess.CompletedProcess:
        """Run ``argv`` on host e with a ``role`` token (None: none) and the TLS files."""
        full = {k: v for k, v in os.environ.items()
                if not k.startswith(("KVSTORE_TOKEN", "KVSTORE_TLS"))}
        full.update(self.creds.client_env(role), **(env or {}))
        return subprocess.run(self.client_args(argv), env=full, capture_output=True, text=True,
                              timeout=timeout_s)

    def describe(self) -> dict:
        """The cluster for ``kvstore chaos --attach`` (addresses and pids)."""
        return {"seed": self.seed,
                "shards": [[{"address": m.address, "pid": m.proc.pid} for m in shard]
                           for shard in self.store.shards],
                "nodes": {name: {"pid": c.proc.pid, "address": c.address}
                          for name, c in self.store.nodes.items()},
                "conductor": self.conductor.address if self.conductor else "",
                "http": self.conductor.info.get("http_address", "") if self.conductor else "",
                "engines": {name: c.address for name, c in self.engines.items()},
                "hosts": {h.name: {"netns": h.netns, "address": h.address}
                          for h in self.hosts.hosts.values()}}

    def stop(self) -> None:
        self.procs.stop()
        if self.etcd is not None and self.etcd.poll() is None:
            self.etcd.kill()
            self.etcd.wait()


def start_multihost(hosts: NetHosts, folder: str, *, secure: bool = True, tls: bool = True,
                    node_dram: str = "256MiB", node_ttl_ms: int = 2000,
                    engines: bool = True, on_step=None) -> MultiHost:
    """Start the layout on ``hosts`` (a started :class:`NetHosts` with hosts a..e).

    Args:
        folder: credentials, etcd data and process logs go here.
        secure: ``--auth`` (and with ``tls``, TLS) on every server.
        engines: also start the engines and the conductor on host d.

    Raises:
        ChildFailed: a process did not come up (everything started is stopped).
    """
    say = on_step or (lambda line: None)
    folder = Path(folder)
    creds = make_credentials(folder / "credentials", [h.address for h in hosts.hosts.values()],
                             tls=tls and secure)
    server = creds.server_args() if secure else ["--insecure"]
    procs = ProcessGroup(log_dir=str(folder / "logs"))
    a, b, c, d = (hosts[n].address for n in "abcd")
    shard_map = ",".join("|".join(f"{a}:{p}" for p in ports) for ports in MASTER_PORTS)
    store = StoreCluster(procs, shard_map, [])
    mh = MultiHost(hosts, creds, procs, store)
    try:
        mh.etcd = start_etcd(hosts, folder / "etcd")
        say(f"etcd on host a (127.0.0.1:{ETCD_PORT} there)")
        cluster = f"mh{hosts.id}"
        for i, ports in enumerate(MASTER_PORTS):
            store.shards.append([])
            for j, port in enumerate(ports):
                name = f"master{i}-{j}"
                store.shards[i].append(procs.start(name, service_args(
                    "master", "--host", a, "--port", str(port), "--shard-id", str(i),
                    "--shard-map", shard_map, "--etcd", f"http://127.0.0.1:{ETCD_PORT}",
                    "--cluster-name", cluster, "--node-ttl-ms", str(node_ttl_ms), *server),
                    prefix=hosts.exec_args("a")))
                say(f"{name}: shard {i} on host a at {a}:{port}")
        node_env = creds.client_env("node") if secure else {}
        for name, host, bind in (("b0", "b", "0.0.0.0"), ("b1", "b", b), ("c0", "c", c)):
            store.nodes[name] = procs.start(name, service_args(
                "node", "--master", store.master, "--host", bind, "--node-id", name,
                "--dram", node_dram, "--eviction-policy", "default", *server),
                env=node_env, prefix=hosts.exec_args(host))
            say(f"{name}: node on host {host} at {store.nodes[name].address}")
        if engines:
            _start_serving(mh, d, server, creds.client_env("client") if secure else {}, say)
    except BaseException:
        mh.stop()
        raise
    return mh


def _start_serving(mh: MultiHost, d: str, server: list[str], env: dict, say) -> None:
    on_d = mh.hosts.exec_args("d")
    common = ["--master", mh.seed, "--host", d, "--model", "tiny", "--block-tokens", "16"]
    routes = []
    for role in ("prefill", "decode"):
        child = mh.procs.start(f"{role}0", service_args(role, *common, "--instance-id",
                                                        f"{role}0", *server),
                               env=env, prefix=on_d, timeout_s=120)
        mh.engines[f"{role}0"] = child
        routes += [f"--{role}", f"{role}0={child.address}"]
        say(f"{role}0: engine on host d at {child.address}")
    mh.conductor = mh.procs.start("conductor", service_args(
        "conductor", *common, *routes, "--http-port", "0", "--http-host", d, *server),
        env=env, prefix=on_d, timeout_s=120)
    say(f"conductor on host d at {mh.conductor.address} "
        f"(HTTP {mh.conductor.info.get('http_address', '')})")


def start_etcd(hosts: NetHosts, data_dir: Path, timeout_s: float = 20.0, host: str = "a",
               address: str = "127.0.0.1") -> subprocess.Popen:
    """etcd on ``host`` at ``address`` (default: host a's loopback, where only the
    masters on host a reach it); waits until it answers.

    Raises:
        ChildFailed: it exited or did not answer within ``timeout_s``.
    """
    url = f"http://{address}:{ETCD_PORT}"
    peer = f"http://{address}:{ETCD_PORT + 1}"
    data_dir.mkdir(parents=True, exist_ok=True)
    log = open(data_dir.with_suffix(".log"), "ab")
    proc = hosts.popen(host, ["etcd", "--name", "kv", "--data-dir", str(data_dir),
                             "--listen-client-urls", url, "--advertise-client-urls", url,
                             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                             "--initial-cluster", f"kv={peer}"],
                       stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    probe = (f"from kvstore.master.election import Etcd; Etcd({url!r}).get('/kvstore/ping')")
    deadline = time.monotonic() + timeout_s
    while True:
        if hosts.run(host, [sys.executable, "-c", probe], capture_output=True).returncode == 0:
            return proc
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise ChildFailed(f"etcd did not start on host {host} "
                              f"(see {data_dir.with_suffix('.log')})")
        time.sleep(0.2)


def hosts_command(
    folder: Annotated[str, typer.Option(help="credentials, logs and cluster.json "
                                             "(default: a temp dir)")] = "",
    insecure: Annotated[bool, typer.Option("--insecure", help="no --auth and no TLS "
                                                              "(every server warns)")] = False,
    no_tls: Annotated[bool, typer.Option("--no-tls", help="--auth without TLS")] = False,
    no_engines: Annotated[bool, typer.Option("--no-engines", help="the store only")] = False,
) -> None:
    """``kvstore hosts``: the multi-host layout on this machine until Ctrl-C."""
    from rich.console import Console
    from rich.table import Table

    from kvstore.tools.cluster.netns import NetnsError, unavailable

    console = Console()
    why = unavailable()
    if why:
        typer.echo(f"kvstore hosts: error: {why}", err=True)
        raise typer.Exit(2)
    folder = folder or tempfile.mkdtemp(prefix="kvstore-hosts-")
    try:
        hosts = NetHosts(list(HOSTS)).start()
    except NetnsError as exc:
        typer.echo(f"kvstore hosts: error: {exc}", err=True)
        raise typer.Exit(1)
    try:
        mh = start_multihost(hosts, folder, secure=not insecure, tls=not no_tls,
                             engines=not no_engines, on_step=console.print)
    except ChildFailed as exc:
        hosts.close()
        console.print(f"[red]a process failed:[/] {exc}")
        raise typer.Exit(1)
    try:
        desc = mh.describe()
        (Path(folder) / "cluster.json").write_text(json.dumps(desc, indent=2))
        table = Table("host", "namespace", "address", "runs")
        runs = {"a": "etcd, 4 masters (2 shards)", "b": "nodes b0, b1", "c": "node c0",
                "d": "prefill0, decode0, conductor", "e": "your clients"}
        for name, netns, address in hosts.table():
            table.add_row(name, netns, address, runs[name])
        console.print(table)
        env = " ".join(f"{k}={v}" for k, v in mh.creds.client_env("client").items())
        console.print(f"credentials in {mh.creds.folder}; cluster in {folder}/cluster.json\n"
                      f"a client on host e:\n"
                      f"  ip netns exec {hosts['e'].netns} env {env} "
                      f"kvstore replay --conductor {desc['conductor']} -n 50\n"
                      f"  ip netns exec {hosts['e'].netns} env {env} "
                      f"kvstore chaos --attach {folder}/cluster.json\n"
                      f"Ctrl-C stops everything and removes the namespaces.")
        while True:
            mh.procs.check()
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    except ChildFailed as exc:
        console.print(f"[red]{exc}[/]")
    finally:
        mh.stop()
        hosts.close()
