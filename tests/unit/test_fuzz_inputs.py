"""``kvstore fuzz`` without a network: reproducible generators, the node's framing rules, the split."""

from __future__ import annotations

import hashlib
import random

import pytest

from kvstore.tools.faults.fuzz.framing import End, plan
from kvstore.tools.faults.fuzz.frames import frame
from kvstore.tools.faults.fuzz.runner import WEIGHTS, batch_sizes, generator, split
from kvstore.tools.faults.fuzz.report import SURFACES
from kvstore.transfer.protocol import Op


def _digest(surface: str, seed: int, n: int) -> tuple[str, set[str]]:
    gen = generator(surface, seed)
    h = hashlib.sha256()
    kinds = set()
    for _ in range(n):
        item = gen.next()
        h.update(item.fingerprint())
        kinds.add(item.kind)
    return h.hexdigest(), kinds


@pytest.mark.parametrize("surface", SURFACES)
def test_the_same_seed_makes_the_same_inputs(surface):
    first, kinds = _digest(surface, 7, 2000)
    again, _ = _digest(surface, 7, 2000)
    other, _ = _digest(surface, 8, 2000)
    assert first == again
    assert first != other
    assert len(kinds) >= 12, kinds           # the cases, not one of them over and over


def test_another_process_makes_the_same_inputs(tmp_path):
    """Across processes too, whatever their hash seed (protobuf maps, sets, dicts)."""
    import os
    import subprocess
    import sys

    code = ("import sys; sys.path[:0] = " + repr([os.path.dirname(__file__)]) + "\n"
            "from test_fuzz_inputs import _digest, SURFACES\n"
            "print(' '.join(_digest(s, 7, 500)[0] for s in SURFACES))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, cwd=tmp_path,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout
            for seed in ("1", "2", "random")}
    assert len(outs) == 1
    assert outs.pop().split() == [_digest(s, 7, 500)[0] for s in SURFACES]


def test_the_surfaces_draw_from_their_own_streams():
    # data-tcp and data-unix use the same generator on streams of their own.
    assert _digest("data-tcp", 1, 200)[0] != _digest("data-unix", 1, 200)[0]


def test_generators_do_not_touch_the_global_random_state():
    random.seed(123)
    expected = random.random()
    random.seed(123)
    for surface in SURFACES:
        _digest(surface, 1, 300)
    assert random.random() == expected


def test_the_framing_rules_of_the_node():
    ping = frame(Op.PING)
    get = frame(Op.GET, b"k")
    put = frame(Op.PUT, b"k", size=3, value=b"abc")
    p = plan(ping + get + put, authed=True)
    assert p.replies == (Op.PING, Op.GET, Op.PUT) and p.end is End.OPEN
    assert p.consumed == len(ping + get + put)
    # Anything but the handshake before it: one refusal, then the node closes.
    p = plan(ping + get, authed=False)
    assert p.replies == (Op.PING,) and p.end is End.CLOSED and p.consumed == len(ping)
    assert plan(frame(Op.AUTH_HELLO) + ping, authed=False).replies == (Op.AUTH_HELLO, Op.PING)
    # A proof the fuzzer made is never right; one too long is not read at all.
    p = plan(frame(Op.AUTH_PROVE, size=32, value=b"x" * 32) + ping, authed=True)
    assert p.end is End.CLOSED and p.consumed == 32 + 32
    assert plan(frame(Op.AUTH_PROVE, size=65), authed=True).end is End.CLOSED
    # Names over 8 KiB or an unknown op: the stream cannot be trusted.
    assert plan(frame(Op.GET, key_len=8000, parent_len=200), authed=True).end is End.CLOSED
    assert plan(frame(99) + ping, authed=True).replies == (99,)
    # Cut short: a value, the names or the header.
    assert plan(frame(Op.PUT, b"k", size=10, value=b"abc"), authed=True).end is End.PARTIAL
    assert plan(frame(Op.GET, b"key")[:-1], authed=True).end is End.PARTIAL
    assert plan(ping[:20], authed=True).end is End.PARTIAL
    assert plan(ping + ping[:20], authed=True).replies == (Op.PING,)
    # RDMA_CONNECT: its payload is read (no RDMA here: an error reply) unless too long.
    assert plan(frame(32, size=4, value=b"abcd") + ping, authed=True).replies == (32, Op.PING)
    assert plan(frame(32, size=5000), authed=True).end is End.CLOSED


def test_the_split_and_the_batches():
    assert split(12, list(SURFACES)) == {"data-tcp": 3, "data-unix": 3, "master": 3, "http": 1,
                                         "resp": 2}
    total = sum(WEIGHTS[s] for s in SURFACES)
    for n in (1, 7, 999, 1_000_000):
        shares = split(n, list(SURFACES))
        assert sum(shares.values()) == n
        assert all(abs(shares[s] - n * WEIGHTS[s] / total) < 1 for s in SURFACES)
    assert split(5, ["master"]) == {"master": 5}
    assert batch_sizes(1_000_000, 5000, 20_000) == [20_000] + [5000] * 196
    assert batch_sizes(2000, 500, 20_000) == [1000, 500, 500]
    assert sum(batch_sizes(12_345, 1000, 300)) == 12_345


def test_an_attached_cluster_is_read_from_its_description(tmp_path):
    import json

    from kvstore.tools.faults.fuzz.cluster import Target

    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"master": "10.0.0.1:50051", "node": "10.0.0.2:7000",
                                "http": "10.0.0.3:8000", "tokens": {"client": "c" * 16},
                                "pids": {"master": 12}}))
    t = Target.attach(str(path))
    assert (t.master, t.node_tcp, t.node_unix, t.http) == ("10.0.0.1:50051", ("10.0.0.2", 7000),
                                                          "", "10.0.0.3:8000")
    assert t.tokens == {"client": "c" * 16} and t.pids == {"master": 12}
