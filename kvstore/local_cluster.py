"""An embedded local cluster: every component as its own process on loopback.

    master <- 2 store nodes (shm DRAM)        engines: N prefill, M decode
                                  conductor -> engines, store
                                  (+ OpenAI-style HTTP front inside it, optional)

Ports are chosen at run time (each child binds port 0 and reports it in its
READY line). Stopping the :class:`LocalCluster` (context manager, Ctrl-C or a
failed child) stops every process.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.process import Child, Cluster


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    num_nodes: int = 2
    node_dram: str = "512MiB"          # per node
    num_prefill: int = 1
    num_decode: int = 1
    model: str = "tiny"
    block_tokens: int = 16
    kv_pages: int = 4096               # per engine
    use_cache: bool = True
    log_dir: str | None = None
    http_port: int | None = None       # serve the HTTP front on it (0: any free port); None: off
    conductor_args: tuple[str, ...] = ()   # extra conductor options (deadlines, probes)


class LocalCluster:
    """Start master, store nodes, engines and the conductor; stop them all on exit."""

    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.procs = Cluster(log_dir=spec.log_dir)
        self.master = ""
        self.conductor = ""
        self.http = ""                  # HTTP front host:port, "" when off

    def start(self, on_step=None) -> "LocalCluster":
        s = self.spec
        step = on_step or (lambda name: None)
        try:
            step("master")
            self.master = self.procs.start("master", ["-m", "kvstore.master.server"]).address
            for i in range(s.num_nodes):
                step(f"store node {i}")
                self.procs.start(f"node{i}", ["-m", "kvstore.store.server", "--master", self.master,
                                              "--node-id", f"node{i}", "--dram", s.node_dram])
            common = ["--master", self.master, "--model", s.model, "--block-tokens",
                      str(s.block_tokens), "--kv-pages", str(s.kv_pages)]
            prefill, decode = [], []
            for i in range(s.num_prefill):
                step(f"prefill engine {i}")
                c = self.procs.start(f"prefill{i}", ["-m", "engines.prefill_server", *common,
                                                     "--instance-id", f"prefill{i}"], timeout_s=120)
                prefill += ["--prefill", f"prefill{i}={c.address}"]
            for i in range(s.num_decode):
                step(f"decode engine {i}")
                c = self.procs.start(f"decode{i}", ["-m", "engines.decode_server", *common,
                                                    "--instance-id", f"decode{i}"], timeout_s=120)
                decode += ["--decode", f"decode{i}={c.address}"]
            step("conductor")
            args = ["-m", "conductor.service", "--master", self.master, "--model", s.model,
                    "--block-tokens", str(s.block_tokens), *prefill, *decode]
            if not s.use_cache:
                args.append("--no-cache")
            if s.http_port is not None:
                args += ["--http-port", str(s.http_port)]
            args += list(s.conductor_args)
            c = self.procs.start("conductor", args, timeout_s=120)
            self.conductor = c.address
            self.http = c.info.get("http_address", "")
        except BaseException:
            self.stop()
            raise
        return self

    def process(self, name: str) -> Child:
        """The child called ``name`` ("master", "node0", "prefill1", "decode0", "conductor")."""
        for c in self.procs.children:
            if c.name == name:
                return c
        raise KeyError(name)

    def check(self) -> None:
        """Raise ChildFailed if any process died."""
        self.procs.check()

    def stop(self) -> None:
        self.procs.stop()

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
