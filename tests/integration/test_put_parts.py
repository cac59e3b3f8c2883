"""Values written part by part (layer-wise saves) through real master and node processes.

``KVClient.put_parts`` reserves first, takes parts in order and publishes at
commit with the checksum computed on the way: readers see nothing before the
commit and the whole value after it, on the shared-memory path and over TCP.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.client import KVClient
from kvstore.errors import InvalidArgument, KeyConflict, NotFound, Unavailable
from kvtest import cluster_running, wait_for

LAYERS, LAYER_BYTES = 4, 16 * 1024


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with cluster_running(str(tmp_path_factory.mktemp("parts-logs")), num_nodes=1,
                         dram="64MiB") as running:
        yield running


def value(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (LAYERS, LAYER_BYTES), dtype=np.uint8)


@pytest.mark.parametrize("prefer_shm", [True, False], ids=["shm", "tcp"])
def test_parts_in_layer_order_make_whole_values(cluster, prefer_shm):
    tag = "shm" if prefer_shm else "tcp"
    keys = [f"parts/{tag}/{i}" for i in range(3)]
    values = [value(i) for i in range(3)]
    with KVClient(cluster.master, prefer_shm=prefer_shm) as kv, \
            KVClient(cluster.master, prefer_shm=False) as reader:
        w = kv.put_parts(keys, [v.nbytes for v in values], parents=[None, keys[0], keys[1]])
        for layer in range(LAYERS):
            for i, v in enumerate(values):
                w.write(i, layer * LAYER_BYTES, v[layer])
            # Nothing is visible before the commit.
            assert not any(reader.batch_exists(keys))
        assert w.commit() == [True, True, True]
        assert [bytes(reader.get(k)) for k in keys] == [v.tobytes() for v in values]
        assert [bytes(kv.get(k)) for k in keys] == [v.tobytes() for v in values]

        # Again: the shard decides when the nodes report the values STORED, as for
        # every put: equal bytes are already present; other bytes of the same
        # size, and another size, are conflicts; nothing changes, and the
        # nodes drop the refused copies.
        used = kv.node_stats()["n0"]["used_bytes"]
        again = kv.put_parts(keys, [values[0].nbytes, values[1].nbytes, 10])
        assert all(again.is_open(i) for i in range(3))
        for layer in range(LAYERS):
            again.write(0, layer * LAYER_BYTES, values[0][layer])
            again.write(1, layer * LAYER_BYTES, values[2][layer])
        again.write(2, 0, b"0123456789")
        res = again.commit()
        assert res[0] is False and isinstance(res[1], KeyConflict)
        assert isinstance(res[2], KeyConflict)
        assert [bytes(reader.get(k)) for k in keys] == [v.tobytes() for v in values]
        wait_for(lambda: kv.node_stats()["n0"]["used_bytes"] == used)


def test_out_of_order_and_incomplete_values_are_not_stored(cluster):
    with KVClient(cluster.master) as kv:
        v = value(7)
        w = kv.put_parts(["parts/gap", "parts/short"], [v.nbytes, v.nbytes])
        with pytest.raises(InvalidArgument):
            w.write(0, LAYER_BYTES, v[1])             # layer 0 missing
        w.write(0, 0, v.reshape(-1))
        w.write(1, 0, v[0])                           # only one layer of four
        res = w.commit()
        assert res[0] is True and isinstance(res[1], InvalidArgument)
        assert bytes(kv.get("parts/gap")) == v.tobytes()
        with pytest.raises(NotFound):
            kv.get("parts/short")
        # The failed key is free again: a whole put of it works.
        assert kv.put("parts/short", v) is True


def test_abort_gives_everything_back(cluster):
    with KVClient(cluster.master) as kv:
        used = kv.node_stats()["n0"]["used_bytes"]
        with pytest.raises(RuntimeError):
            with kv.put_parts(["parts/aborted"], [LAYERS * LAYER_BYTES]) as w:
                w.write(0, 0, value(8)[0])
                raise RuntimeError("the engine failed mid-prefill")
        assert isinstance(w.results[0], InvalidArgument)
        assert kv.node_stats()["n0"]["used_bytes"] == used
        with pytest.raises(NotFound):
            kv.get("parts/aborted")
        assert kv.put("parts/aborted", value(9)) is True


def test_the_block_commits_at_its_end(cluster):
    with KVClient(cluster.master) as kv:
        v = value(10)
        with kv.put_parts(["parts/with", "parts/with-short"], [v.nbytes, v.nbytes]) as w:
            for layer in range(LAYERS):
                w.write(0, layer * LAYER_BYTES, v[layer])
            w.write(1, 0, v[0])
        assert w.results[0] is True and isinstance(w.results[1], InvalidArgument)
        assert bytes(kv.get("parts/with")) == v.tobytes()


def test_a_writer_whose_client_closed_never_writes_into_the_segment(cluster):
    """The closed connection gave the reservation back; the range may hold
    another object by now, which must keep its bytes."""
    owner = KVClient(cluster.master)
    w = owner.put_parts(["parts/orphan"], [1 << 20])
    w.write(0, 0, b"s" * 16)
    owner.close()
    with KVClient(cluster.master) as kv:
        victims = [f"parts/victim{i}" for i in range(4)]
        wait_for(lambda: all(r is None for r in kv.batch_put(victims, [b"V" * (1 << 20)] * 4)))
        with pytest.raises(Unavailable):
            w.write(0, 16, b"X" * ((1 << 20) - 16))
        assert isinstance(w.commit()[0], Unavailable)
        assert all(bytes(v) == b"V" * (1 << 20) for v in kv.batch_get(victims))
        with pytest.raises(Unavailable, match="closed"):
            owner.get("parts/victim0")
