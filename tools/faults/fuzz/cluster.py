"""The cluster a fuzz run works on: started here with ``--auth``, or attached to.

    master (--auth)  <-  node n0 (--auth, node token, 64 MiB DRAM, shm + Unix socket)
    prefill0, decode0 (--model tiny, client token)  <-  conductor (+ HTTP front, --auth)
    resp-front (kvstore resp --auth, admin token to the store)

Every process gets the same fresh token file (one token per role, and two
client tokens bound to the tenants ``fuzz-a`` and ``fuzz-b``). The fuzzer
sends inputs without a token, with bad tokens, and with each role's token;
the checker reads with the client token, and tries tenant ``fuzz-a``'s
objects with ``fuzz-b``'s token (cross-tenant reads, :mod:`.checks`). Services log at ERROR only:
the master logs every refused call at WARNING, which over a million inputs
is the log, not the product, under test (tracebacks of real failures are
logged at ERROR and stay).
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass, field

from kvstore.tools.cluster.launcher import start_store_cluster
from kvstore.tools.cluster.processes import ProcessGroup, service_args

ROLES = ("admin", "client", "node")
#: Tokens of the two tenants' clients (Target.tokens keys) and their tenants.
TENANT_TOKENS = {"tenant_a": "fuzz-a", "tenant_b": "fuzz-b"}


@dataclass(frozen=True, slots=True)
class Target:
    """Where the fuzzer sends inputs, and which processes it watches.

    ``pids`` maps a process name (``master``, ``node``, ``conductor``,
    ``prefill``, ``decode``) to its pid; the checker polls each and samples
    the RSS of master, node and conductor.
    """

    master: str                          # gRPC host:port
    node_tcp: tuple[str, int]            # data port
    node_unix: str                       # the node's Unix socket address ("" none)
    http: str                            # conductor HTTP front host:port ("" none)
    tokens: dict[str, str]               # role -> token
    pids: dict[str, int] = field(default_factory=dict)
    resp: str = ""                       # the RESP front (kvstore resp) host:port ("" none)

    @staticmethod
    def attach(path: str) -> "Target":
        """A running cluster described by a JSON file::

            {"master": "h:p", "node": "h:p", "node_unix": "", "http": "h:p", "resp": "h:p",
             "tokens": {"admin": "...", "client": "...", "node": "...",
                        "tenant_a": "...", "tenant_b": "..."},
             "pids": {"master": 12, "node": 34, "conductor": 56}}

        Its servers must run with ``--auth`` (the data port's framing rules
        in :mod:`.framing` assume it) and without TLS. ``tokens`` needs the
        client's; inputs meant for a role not given go without a token;
        ``tenant_a`` / ``tenant_b`` (client tokens bound to tenants ``fuzz-a`` and
        ``fuzz-b`` only) enable the cross-tenant check. ``node_unix`` is the node's Unix socket
        (:func:`kvstore.transfer.protocol.local_address` of its shm segment; ""
        skips that surface). Processes are polled with ``kill -0`` and their
        RSS read from ``/proc``: they must run on this machine (``pids`` may be
        empty: liveness is then not checked).

        Raises:
            OSError, ValueError, KeyError: the file cannot be read or is malformed.
        """
        with open(path, encoding="utf-8") as f:
            desc = json.load(f)
        host, _, port = str(desc["node"]).rpartition(":")
        return Target(str(desc["master"]), (host, int(port)), str(desc.get("node_unix", "")),
                      str(desc.get("http", "")), {str(k): str(v) for k, v in desc["tokens"].items()},
                      {str(k): int(v) for k, v in desc.get("pids", {}).items()},
                      str(desc.get("resp", "")))


@dataclass
class FuzzCluster:
    """A cluster started for a run; :meth:`stop` ends every process."""

    procs: ProcessGroup
    target: Target

    def stop(self) -> None:
        self.procs.stop()


def start_fuzz_cluster(log_dir: str, http: bool = True, dram: str = "64MiB",
                       on_step=None, resp: bool = True) -> FuzzCluster:
    """Start a master, a node and (with ``http``) the engines and the conductor, all with ``--auth``.

    Args:
        log_dir: the token file and every process's log go here.
        http: also start prefill, decode and the conductor's HTTP front (the
            engines take most of the start-up time).
        resp: also start the RESP front.
        dram: the node's DRAM tier.
        on_step: called with a line per started process.

    Raises:
        ChildFailed: a process did not come up (everything started is stopped).
    """
    say = on_step or (lambda line: None)
    tokens = {role: f"{role}-{secrets.token_hex(16)}" for role in (*ROLES, *TENANT_TOKENS)}
    auth = os.path.join(log_dir, "tokens")
    with open(os.open(auth, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write("".join(f"{role} {tokens[role]}\n" for role in ROLES))
        f.write("".join(f"client {tokens[name]} tenants={tenant}\n"
                        for name, tenant in TENANT_TOKENS.items()))
    quiet = ("--log-level", "ERROR")
    procs = ProcessGroup(log_dir=log_dir)
    try:
        store = start_store_cluster(1, 1, dram=dram, eviction_policy="default", procs=procs,
                                    master_args=("--auth", auth, *quiet),
                                    node_args=("--auth", auth, *quiet),
                                    env={"KVSTORE_TOKEN": tokens["node"]}, on_step=say)
        node = store.nodes["n0"]
        host, _, port = node.address.rpartition(":")
        from kvstore.transfer.protocol import local_address

        pids = {"master": store.shards[0][0].proc.pid, "node": node.proc.pid}
        http_address = ""
        if http:
            client_env = {"KVSTORE_TOKEN": tokens["client"]}
            common = ["--master", store.master, "--model", "tiny", "--block-tokens", "16",
                      "--auth", auth, *quiet]
            routes = []
            for role in ("prefill", "decode"):
                child = procs.start(f"{role}0", service_args(
                    role, *common, "--kv-pages", "256", "--instance-id", f"{role}0"),
                    env=client_env, timeout_s=120)
                pids[role] = child.proc.pid
                routes += [f"--{role}", f"{role}0={child.address}"]
                say(f"{role}0: engine at {child.address}")
            conductor = procs.start("conductor", service_args(
                "conductor", *common, *routes, "--http-port", "0"), env=client_env,
                timeout_s=120)
            pids["conductor"] = conductor.proc.pid
            http_address = conductor.info["http_address"]
            say(f"conductor: HTTP front at {http_address}")
        resp_address = ""
        if resp:
            front = procs.start("resp-front", service_args(
                "resp", "--master", store.master, "--auth", auth, *quiet),
                env={"KVSTORE_TOKEN": tokens["admin"]})
            pids["resp"] = front.proc.pid
            resp_address = front.address
            say(f"resp-front: RESP front at {resp_address}")
        target = Target(store.master, (host, int(port)), local_address(node.info["shm_name"]),
                        http_address, tokens, pids, resp_address)
    except BaseException:
        procs.stop()
        raise
    return FuzzCluster(procs, target)
