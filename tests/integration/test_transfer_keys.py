"""KV handed from prefill to decode under transfer keys leaves the store with the request.

The decode engine removes a request's transfer keys once it loaded them; a
request with ``max_tokens`` 1 never reaches decode, so the conductor removes
them. With the cache off every block goes by a transfer key, with it on the
partial last block does. After requests of both kinds, no ``xfer/`` key is left.
"""

from __future__ import annotations

import random

import grpc
import pytest

from kvstore._proto import serving_pb2 as spb
from kvstore._proto import serving_pb2_grpc as spb_grpc
from kvstore.client import KVClient
from kvstore.tools.cluster.launcher import ClusterSpec, LocalCluster


@pytest.mark.parametrize("use_cache", [True, False])
def test_no_transfer_key_outlives_its_request(tmp_path, use_cache):
    spec = ClusterSpec(node_dram="64MiB", kv_pages=512, block_tokens=16, use_cache=use_cache,
                       log_dir=str(tmp_path / "logs"))
    rng = random.Random(3)
    with LocalCluster(spec) as cluster, grpc.insecure_channel(cluster.conductor) as ch:
        stub = spb_grpc.ConductorStub(ch)
        for i, max_tokens in enumerate([1, 3, 1, 2, 1]):
            prompt = [rng.randrange(2048) for _ in range(40 + 16 * i)]   # 8 tokens past a block
            chunks = list(stub.Generate(spb.GenerateRequest(
                request_id=f"r{i}", prompt_tokens=prompt, max_tokens=max_tokens), timeout=60))
            assert not chunks[-1].error, chunks[-1].error
            assert sum(len(c.tokens) for c in chunks) == max_tokens
        with KVClient(cluster.master) as kv:
            assert [m.key for m in kv.list("xfer/")] == []
