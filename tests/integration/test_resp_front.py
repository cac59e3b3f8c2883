"""Issue 16: real Redis clients against ``kvstore resp`` over a real master and nodes.

redis-cli (Debian's redis-tools), redis-py (RESP3 by default with HELLO 3,
and protocol=2; sync and asyncio), redis-benchmark, the LMCache redis://
connector's command pattern (LMCache's own code: tests/with_lmcache),
``--auth`` roles, and malformed input. The
shared session cluster (a master, two 64 MiB nodes) holds the data; each
test uses its own key prefix.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import uuid

import pytest

redis = pytest.importorskip("redis")
import redis.asyncio as aredis  # noqa: E402
from redis.backoff import NoBackoff  # noqa: E402
from redis.retry import Retry  # noqa: E402

from kvstore.tools.cluster.processes import ProcessGroup, service_args  # noqa: E402
from kvtest import wait_for  # noqa: E402

SIZES = (0, 1, 64 * 1024, 4 * 1024 * 1024)
TOKENS = {role: f"{role}-{secrets.token_hex(16)}" for role in ("admin", "client", "node",
                                                                 "metrics")}


def need(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        pytest.skip(f"{binary} is not installed (Debian: apt-get install redis-tools)")
    return path


@pytest.fixture(scope="module")
def fronts(cluster, tmp_path_factory):
    """Two fronts over the shared cluster: open, and with --auth (port numbers)."""
    tmp = tmp_path_factory.mktemp("resp")
    auth = tmp / "tokens"
    auth.write_text("".join(f"{role} {tok}\n" for role, tok in TOKENS.items()))
    with ProcessGroup(str(tmp)) as procs:
        open_front = procs.start("resp", service_args("resp", "--master", cluster.master))
        authed = procs.start("resp-auth", service_args("resp", "--master", cluster.master,
                                                       "--auth", str(auth)))
        yield {"open": open_front.info["port"], "auth": authed.info["port"],
               "open_pid": open_front.proc.pid}
        procs.check()


@pytest.fixture
def port(fronts) -> int:
    return fronts["open"]


@pytest.fixture
def prefix() -> str:
    return f"resp-{uuid.uuid4().hex[:10]}:"


def cli(port: int, *args: str, stdin: str | None = None) -> str:
    out = subprocess.run([need("redis-cli"), "-p", str(port), *args], input=stdin,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_redis_cli(port, prefix):
    assert cli(port, "PING").strip() == "PONG"
    assert cli(port, "SET", prefix + "a", "hello").strip() == "OK"
    assert cli(port, "GET", prefix + "a").strip() == "hello"
    assert cli(port, "SET", prefix + "a", "hello").strip() == "OK"          # equal bytes
    assert "KEYCONFLICT" in cli(port, "SET", prefix + "a", "other")
    assert cli(port, "GET", prefix + "missing").strip() == ""                # nil
    for i in range(12):
        cli(port, "SET", f"{prefix}k{i}", "x" * (i + 1))
    found = cli(port, "--scan", "--pattern", prefix + "k1*").split()
    assert sorted(found) == sorted([prefix + "k1", prefix + "k10", prefix + "k11"])
    info = cli(port, "INFO")
    for line in ("redis_version:", "connected_clients:", "used_memory:", "maxmemory_policy:none",
                 "keyspace_hits:", "# Keyspace", "# kvstore", "tier_dram:", "hit_rate:"):
        assert line in info
    assert cli(port, "DEL", prefix + "a", prefix + "nope").strip() == "1"
    assert cli(port, "EXISTS", prefix + "a").strip() == "0"
    # Inline commands, typed by hand, pipelined in one write.
    typed = cli(port, stdin=f'PING\nSET {prefix}q "a b"\nGET {prefix}q\nTTL {prefix}q\n')
    assert typed.split("\n")[:4] == ["PONG", "OK", "a b", "-1"]


def test_redis_cli_bigkeys_and_memkeys(port, prefix):
    cli(port, "SET", prefix + "big", "y" * 5000)
    big = cli(port, "--bigkeys")
    assert "Biggest string found" in big and "strings with" in big
    mem = cli(port, "--memkeys")
    assert "Biggest string found" in mem
    usage = int(cli(port, "MEMORY", "USAGE", prefix + "big"))
    assert usage == 5000 + len((prefix + "big").encode())


@pytest.mark.parametrize("protocol", [3, 2])
def test_redis_py_sync(port, prefix, protocol):
    r = redis.Redis(port=port, protocol=protocol)
    try:
        assert r.ping()
        values = {f"{prefix}v{size}": os.urandom(size) for size in SIZES}
        for k, v in values.items():
            assert r.set(k, v) is True
            assert r.get(k) == v                     # byte-exact, 0 B included
        assert r.get(prefix + "missing") is None
        assert r.set(prefix + "v1", values[prefix + "v1"], nx=True) is None
        with pytest.raises(redis.ResponseError, match="KeyConflict"):
            r.set(prefix + "v1", b"other")
        with pytest.raises(redis.ResponseError, match="no expiry"):
            r.set(prefix + "ex", b"v", ex=10)
        assert r.set(prefix + "xx", b"v", xx=True) is None
        assert r.mset({prefix + "m1": b"1", prefix + "m2": b""}) is True
        assert r.mget([prefix + "m1", prefix + "m2", prefix + "m3"]) == [b"1", b"", None]
        assert r.exists(prefix + "m1", prefix + "m2", prefix + "m3", prefix + "m1") == 3
        assert r.strlen(prefix + "v65536") == 65536
        assert r.getrange(prefix + "m1", 0, -1) == b"1"
        assert sorted(r.scan_iter(match=prefix + "m*", count=2)) == [
            (prefix + "m1").encode(), (prefix + "m2").encode()]
        pipe = r.pipeline(transaction=False)
        for i in range(500):
            pipe.set(f"{prefix}p{i}", str(i))
        for i in range(500):
            pipe.get(f"{prefix}p{i}")
        out = pipe.execute()
        assert out[:500] == [True] * 500
        assert out[500:] == [str(i).encode() for i in range(500)]
        # A pipelined run of SETs is one batch put; a repeated key keeps the
        # one-after-the-other meaning (equal bytes OK, other bytes KeyConflict).
        pipe = r.pipeline(transaction=False)
        pipe.set(prefix + "dup", b"one").set(prefix + "dup", b"one").set(prefix + "dup", b"two")
        first, second, third = pipe.execute(raise_on_error=False)
        assert first is True and second is True and "KeyConflict" in str(third)
        # A pipelined run of GETs reads a repeated key once; every reply has its
        # bytes, and INFO counts each GET.
        hits0, misses0 = (r.info("stats")[f] for f in ("keyspace_hits", "keyspace_misses"))
        pipe = r.pipeline(transaction=False)
        for k in [prefix + "v65536", prefix + "nope", prefix + "v65536", prefix + "v1",
                  prefix + "nope", prefix + "v65536"]:
            pipe.get(k)
        v64k, v1 = values[prefix + "v65536"], values[prefix + "v1"]
        assert pipe.execute() == [v64k, None, v64k, v1, None, v64k]
        stats = r.info("stats")
        assert (stats["keyspace_hits"] - hits0, stats["keyspace_misses"] - misses0) == (4, 2)
        assert r.delete(*values, prefix + "m1") == len(values) + 1
        assert r.get(prefix + "v0") is None
        if protocol == 3:
            assert r.connection_pool.get_connection().protocol in (3, "3")
    finally:
        r.close()


@pytest.mark.parametrize("protocol", [3, 2])
def test_redis_py_asyncio(port, prefix, protocol):
    async def main():
        r = aredis.Redis(port=port, protocol=protocol)
        try:
            values = {f"{prefix}a{size}": os.urandom(size) for size in SIZES}
            await asyncio.gather(*(r.set(k, v) for k, v in values.items()))
            got = await asyncio.gather(*(r.get(k) for k in values))
            assert got == list(values.values())
            assert await r.mget(list(values)) == list(values.values())
            assert await r.exists(*values) == len(values)
            keys = [k async for k in r.scan_iter(match=prefix + "a*")]
            assert sorted(keys) == sorted(k.encode() for k in values)
            async with r.pipeline(transaction=False) as pipe:
                for i in range(1000):
                    pipe.exists(f"{prefix}a{SIZES[i % 4]}")
                assert await pipe.execute() == [1] * 1000
            assert await r.delete(*values) == len(values)
        finally:
            await r.aclose()
    asyncio.run(main())


def test_lmcache_remote_connector_pattern(port, prefix):
    """LMCache 0.5.6's redis:// connector keeps a chunk as ``<key>metadata`` and
    ``<key>kv_bytes`` with GET / SET / EXISTS / DEL on an asyncio redis-py client.
    (LMCache itself needs an environment of its own, its pins being below
    kvstore's: tests/with_lmcache runs its connector; here the same command
    pattern is replayed in this process.)"""
    async def main():
        r = aredis.Redis(port=port)
        try:
            chunks = {f"{prefix}chunk{i}": (os.urandom(28), os.urandom(256 * 1024))
                      for i in range(8)}
            for key, (meta, kv) in chunks.items():
                assert not await r.exists(key + "metadata")
                await r.set(key + "metadata", meta)
                await r.set(key + "kv_bytes", kv)
            for key, (meta, kv) in chunks.items():
                assert await r.exists(key + "metadata") == 1
                assert await r.get(key + "metadata") == meta
                assert await r.get(key + "kv_bytes") == kv
            for key in chunks:
                assert await r.delete(key + "metadata", key + "kv_bytes") == 2
            assert await r.get(f"{prefix}chunk0kv_bytes") is None
        finally:
            await r.aclose()
    asyncio.run(main())


def test_redis_benchmark(port):
    out = subprocess.run([need("redis-benchmark"), "-p", str(port), "-t", "set,get",
                          "-n", "20000", "-d", "65536", "-P", "16", "-q"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "error" not in (out.stdout + out.stderr).lower(), out.stdout + out.stderr
    rates = [line for line in out.stdout.replace("\r", "\n").split("\n")
             if "requests per second" in line]
    assert any(line.startswith("SET:") for line in rates), out.stdout
    assert any(line.startswith("GET:") for line in rates), out.stdout


def test_auth_roles(fronts, prefix):
    port = fronts["auth"]
    once = Retry(NoBackoff(), 0)     # redis-py retries AuthenticationError by default
    anon = redis.Redis(port=port, protocol=2, retry=once)
    with pytest.raises(redis.AuthenticationError):
        anon.get(prefix + "k")                                       # -NOAUTH
    with pytest.raises(redis.AuthenticationError):                  # -WRONGPASS
        redis.Redis(port=port, password="wrong-token-xxxxxxxxxx", retry=once).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port, username="admin", password=TOKENS["client"], retry=once).ping()
    client = redis.Redis(port=port, username="client", password=TOKENS["client"])  # HELLO 3 AUTH
    assert client.set(prefix + "k", b"v") and client.get(prefix + "k") == b"v"
    for verb in (("FLUSHALL",), ("KVSTORE.INSPECT", prefix + "k"),
                 ("KVSTORE.EVICT", prefix + "k"), ("KEYS", "*")):
        with pytest.raises(redis.ResponseError, match="NOPERM|no permissions"):
            client.execute_command(*verb)
    for role in ("node", "metrics"):      # as on the master: no object reads or writes
        other = redis.Redis(port=port, username=role, password=TOKENS[role], retry=once)
        assert other.ping()
        for verb in (("GET", prefix + "k"), ("SET", prefix + role, b"v"), ("DEL", prefix + "k"),
                     ("EXISTS", prefix + "k"), ("DBSIZE",)):
            with pytest.raises(redis.ResponseError, match="no permissions.*role " + role):
                other.execute_command(*verb)
        other.close()
    admin = redis.Redis(port=port, password=TOKENS["admin"], protocol=2)   # AUTH token
    assert admin.execute_command("KVSTORE.INSPECT", prefix + "k")
    assert admin.execute_command("KVSTORE.EVICT", prefix + "k") == 1
    assert client.get(prefix + "k") is None
    for c in (anon, client, admin):
        c.close()
    # Before authentication only HELLO / AUTH / QUIT are answered.
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"PING\r\nINFO\r\nQUIT\r\n")
        assert _read_all(s) == b"-NOAUTH Authentication required.\r\n" * 2 + b"+OK\r\n"


def _read_all(s: socket.socket) -> bytes:
    chunks = []
    try:
        while data := s.recv(65536):
            chunks.append(data)
    except ConnectionResetError:        # closed with unread input (a protocol error)
        pass
    return b"".join(chunks)


def test_malformed_input_keeps_the_front_serving(port, prefix):
    """Truncated frames, huge declared lengths, binary junk and a deep pipeline:
    each connection gets an error or is closed, and a normal client still works."""
    junk = [b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$10\r\nab",            # truncated, then closed
            b"*1\r\n$99999999999999\r\n", b"*99999999999\r\n",      # over the bounds
            b"*1\r\n$536870912\r\n" + b"x" * 1000,                  # declared 512 MiB, never sent
            b"\x00\xff\x13" * 3000, b"A" * 70_000, b"*2\r\n:1\r\n"]
    for frame in junk:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            try:
                s.sendall(frame)
                s.shutdown(socket.SHUT_WR)
            except OSError:              # the front closed first (a protocol error)
                pass
            _read_all(s)
    # Pipelined GETs (one batch read) before a broken frame are answered, then the error.
    get = b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(prefix) + 1, (prefix + "g").encode())
    for tail, end in ((b"*1\r\n$-5\r\n", b"-ERR Protocol error: invalid bulk length\r\n"),
                      (b"*2\r\n$3\r\nGET\r\n$10\r\nab", b"")):      # truncated: no error
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(get * 3 + tail)
            s.shutdown(socket.SHUT_WR)
            assert _read_all(s) == b"$-1\r\n" * 3 + end
    # An unknown command or a wrong arity keeps the connection usable.
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"NOSUCH a b\r\nGET\r\n" + b"*1\r\n$4\r\nPING\r\n" * 20000 + b"QUIT\r\n")
        got = _read_all(s)
    assert got.startswith(b"-ERR unknown command 'NOSUCH'")
    assert got.count(b"+PONG\r\n") == 20000 and got.endswith(b"+OK\r\n")
    # Its name is echoed as sent: bytes that are not UTF-8 escaped, CR and LF as spaces.
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"*1\r\n$6\r\nNO\xe9\r\nX\r\nQUIT\r\n")
        got = _read_all(s)
    assert got == b"-ERR unknown command 'NO\\xe9  X', with args beginning with: \r\n+OK\r\n"
    r = redis.Redis(port=port)
    assert r.set(prefix + "after", b"ok") and r.get(prefix + "after") == b"ok"
    r.close()



def test_complete_commands_are_answered_while_the_next_one_arrives(port, prefix):
    """A reply never waits behind a command that is still arriving (a large SET in
    flight after a GET): the front answers what is complete before it blocks."""
    key = (prefix + "inflight").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"PING\r\nPI")
        assert s.recv(100) == b"+PONG\r\n"
        s.sendall(b"NG\r\n")
        assert s.recv(100) == b"+PONG\r\n"
        s.sendall(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(key), key)
                  + b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$100\r\nabc" % (len(key), key))
        assert s.recv(100) == b"$-1\r\n"
        s.sendall(b"x" * 97 + b"\r\n")
        assert s.recv(100) == b"+OK\r\n"


def test_max_bulk_bounds_inline_arguments_too(cluster, tmp_path):
    with ProcessGroup(str(tmp_path)) as procs:
        front = procs.start("resp-small", service_args("resp", "--master", cluster.master,
                                                       "--max-bulk", "1KiB"))
        with socket.create_connection(("127.0.0.1", front.info["port"]), timeout=10) as s:
            s.sendall(b"SET inline-big " + b"x" * 2000 + b"\r\n")
            assert _read_all(s) == b"-ERR Protocol error: invalid bulk length\r\n"
        with socket.create_connection(("127.0.0.1", front.info["port"]), timeout=10) as s:
            s.sendall(b"PING " + b"y" * 1000 + b"\r\n")
            assert s.recv(2000).startswith(b"$1000\r\nyyy")

def _rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))


def test_a_client_that_reads_no_replies_holds_a_bounded_part_of_the_front(fronts, prefix):
    # 60 pipelined GETs of a 4 MiB value, never read: the front answers a burst
    # at about 16 MiB of values and then blocks in send; before that bound it
    # fetched 32 values (128 MiB) per burst.
    import time

    r = redis.Redis(port=fronts["open"], protocol=2)
    key = f"{prefix}big"
    r.set(key, os.urandom(4 << 20))
    assert len(r.get(key)) == 4 << 20
    before = _rss_mib(fronts["open_pid"])
    s = socket.create_connection(("127.0.0.1", fronts["open"]))
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        s.sendall(f"GET {key}\r\n".encode() * 60)
        peak = before
        for _ in range(10):                          # the peak, sampled over 2 s
            time.sleep(0.2)
            peak = max(peak, _rss_mib(fronts["open_pid"]))
        assert peak - before < 64, (before, peak)
    finally:
        s.close()
    assert r.ping()                                  # the front serves on


def test_a_front_out_of_descriptors_waits_and_serves_on(cluster, tmp_path):
    """More clients than the fd limit allows (--max-clients above ``ulimit -n``): the
    front backs off accepting, the others wait in the listen queue, and it serves
    again once connections close (it used to exit on EMFILE)."""
    with ProcessGroup(str(tmp_path)) as procs:
        front = procs.start("resp-fds", service_args("resp", "--master", cluster.master),
                            prefix=["sh", "-c", 'ulimit -n 64 && exec "$@"', "sh"])
        socks = []
        try:
            for _ in range(100):
                s = socket.create_connection(("127.0.0.1", front.info["port"]), timeout=10)
                s.sendall(b"PING\r\n")
                socks.append(s)
            assert socks[0].recv(100) == b"+PONG\r\n"
            assert front.proc.poll() is None
        finally:
            for s in socks:
                s.close()
        with socket.create_connection(("127.0.0.1", front.info["port"]), timeout=10) as s:
            s.sendall(b"PING\r\n")
            assert s.recv(100) == b"+PONG\r\n"
        assert front.proc.poll() is None
        procs.check()


def test_front_refuses_a_public_bind_without_auth(cluster):
    args = service_args("resp", "--master", cluster.master, "--host", "0.0.0.0", "--check-config")
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--auth" in out.stderr


def test_select_hello_and_client(port):
    r = redis.Redis(port=port, protocol=3)
    try:
        hello = r.execute_command("HELLO", "3")
        assert hello[b"proto"] == 3 and hello[b"server"] == b"redis"
        assert r.execute_command("SELECT", "0")
        with pytest.raises(redis.ResponseError, match="out of range"):
            r.execute_command("SELECT", "1")
        assert r.client_setname("me") and r.client_getname() in ("me", b"me")
        assert isinstance(r.client_id(), int)
        assert r.config_get("maxmemory-policy")
        assert r.dbsize() >= 0
        assert r.echo(b"\x00bin") == b"\x00bin"
    finally:
        r.close()


def test_bench_rows_beside_redis_server():
    """``kvstore bench --resp``: redis-benchmark rows for the front and a redis-server,
    redis-py rows for both, their rounds alternating (the ratios are the README's,
    not asserted here)."""
    need("redis-benchmark")
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server)")
    from kvstore.tools.bench import resp_peer
    from kvstore.tools.bench.harness import run_systems
    from kvstore.tools.bench.report import check_targets

    rows = run_systems([resp_peer.start], [64 * 1024], use_resp=True, duration_s=0.05,
                       warmup_s=0.01, pool_bytes=4 << 20, node_dram="128MiB")
    got = {(r["system"], r["path"], r["op"]) for r in rows}
    assert got == {(s, path, op) for s in ("redis", "kvstore-resp")
                   for path in ("redis-benchmark", "redis-benchmark-r1000", "redis-py")
                   for op in ("get", "put")}
    assert all(r["ops_per_s"] > 0 for r in rows)
    # CPU per process on the redis-py rows; redis-benchmark's rows are not metered.
    cpu_of = {(r["system"], r["path"]): set(r["cpu_us_per_op"]) for r in rows}
    assert cpu_of[("redis", "redis-py")] == {"redis-server", "client"}
    assert cpu_of[("kvstore-resp", "redis-py")] == {"front", "node", "master", "client"}
    assert cpu_of[("kvstore-resp", "redis-benchmark")] == set()
    measured = {name: value for name, _size, value, _ok in check_targets(rows)}
    assert measured["resp redis-benchmark get >= 0.5x redis-server"] is not None


def test_acl_users_are_tenants_that_cannot_see_each_others_keys(cluster, tmp_path, prefix):
    """``AUTH user pass`` with a token bound to tenant ``user``: the connection's keys
    are that tenant's (``@user/<key>`` in the store), invisible to another tenant;
    ``AUTH pass`` names keys as stored, its token's tenants only."""
    ta, tb = f"alpha-{secrets.token_hex(16)}", f"beta-{secrets.token_hex(16)}"
    auth = tmp_path / "tokens"
    auth.write_text(f"client {ta} tenants=alpha\nclient {tb} tenants=beta\n")
    with ProcessGroup(str(tmp_path)) as procs:
        front = procs.start("resp-tenants", service_args("resp", "--master", cluster.master,
                                                         "--auth", str(auth)))
        p = str(front.info["port"])
        alpha = ("-p", p, "--user", "alpha", "--pass", ta, "--no-auth-warning")
        beta = ("-p", p, "--user", "beta", "--pass", tb, "--no-auth-warning")

        def run(who, *args):
            out = subprocess.run([need("redis-cli"), *who, *args], capture_output=True,
                                 text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            return out.stdout.strip()
        assert run(alpha, "SET", prefix + "k", "from-alpha") == "OK"
        assert run(beta, "SET", prefix + "k", "from-beta") == "OK"      # another tenant's key
        assert run(alpha, "SET", prefix + "only-alpha", "x") == "OK"
        assert run(alpha, "GET", prefix + "k") == "from-alpha"
        assert run(beta, "GET", prefix + "k") == "from-beta"
        assert run(beta, "GET", prefix + "only-alpha") == ""
        assert run(beta, "EXISTS", prefix + "only-alpha") == "0"
        assert run(beta, "DEL", prefix + "only-alpha") == "0"
        assert sorted(run(alpha, "KEYS", prefix + "*").split()) == [prefix + "k",
                                                                     prefix + "only-alpha"]
        assert run(beta, "KEYS", prefix + "*").split() == [prefix + "k"]
        assert run(beta, "SCAN", "0", "MATCH", prefix + "*", "COUNT", "1000").split()[1:] == \
            [prefix + "k"]
        assert run(alpha, "GET", prefix + "only-alpha") == "x"
        # A token used for a tenant it is not bound to: WRONGPASS.
        assert "WRONGPASS" in run(("-p", p), "AUTH", "beta", ta)
        assert "WRONGPASS" in run(("-p", p), "AUTH", "gamma", ta)
        # AUTH token (one argument): keys as stored, of the token's tenants only.
        plain = ("-p", p, "-a", ta, "--no-auth-warning")
        assert run(plain, "GET", f"@alpha/{prefix}k") == "from-alpha"
        assert "NOPERM" in run(plain, "GET", f"@beta/{prefix}k")
        assert "NOPERM" in run(plain, "GET", f"@beta/{prefix}never")     # the same answer
        assert "NOPERM" in run(plain, "GET", f"{prefix}k")                # the default tenant's
        # Store-wide figures are an admin's: a tenant's DBSIZE counts its keys, its
        # INFO hides the others' memory, counters and keyspace.
        assert run(beta, "DBSIZE") == "1"
        info = run(beta, "INFO")
        assert "store_stats:hidden" in info and "db0:keys" not in info
        assert "master_puts" not in info and "used_memory:" not in info
        # A token taken out of the file by a reload: an open connection is not
        # authenticated any more at its next command (as Redis drops a deleted user).
        held = redis.Redis(port=int(p), username="beta", password=tb,
                           retry=Retry(NoBackoff(), 0))
        assert held.get(prefix + "k") == b"from-beta"
        auth.write_text(f"client {ta} tenants=alpha\n")
        front.proc.send_signal(signal.SIGHUP)

        def revoked() -> bool:
            try:
                held.get(prefix + "k")
            except redis.AuthenticationError:
                return True
            except redis.ResponseError as err:
                return "NOAUTH" in str(err) or "Authentication" in str(err)
            return False
        wait_for(revoked, timeout_s=10)
        assert run(alpha, "GET", prefix + "k") == "from-alpha"       # alpha's still holds
        held.close()
        procs.check()
