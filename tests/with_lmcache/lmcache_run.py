"""Run by tests/with_lmcache with LMCache's own interpreter: LMCache 0.5.6's
redis:// remote connector (``RedisConnector``) stores KV chunks in the server
at ``argv[1]`` (a redis:// URL) and reads them back.

Prints one JSON line: {"chunks", "exists_before", "exists_after", "equal", "missing"}.
No kvstore import: LMCache talks RESP and nothing else.
"""

import asyncio
import faulthandler
import json
import os
import sys

import torch

from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.connector.redis_connector import RedisConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

CHUNK = 256                                   # tokens per chunk
# The model's KV: (layers, K/V, tokens, kv heads, head dim); one chunk of it in
# LMCache's KV_2LTD format: (K/V, layers, tokens, hidden), bf16.
KV_SHAPE = (2, 2, CHUNK, 2, 64)
CHUNK_SHAPE = (2, 2, CHUNK, 128)


async def main(url: str, chunks: int) -> dict:
    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, local_cpu=False,
                                               max_local_cpu_size=0.05, remote_url=url)
    metadata = LMCacheMetadata(model_name="kvstore-test", world_size=1, local_world_size=1,
                               worker_id=0, local_worker_id=0, kv_dtype=torch.bfloat16,
                               kv_shape=KV_SHAPE, chunk_size=CHUNK)
    backend = LocalCPUBackend(config, metadata)
    conn = RedisConnector(url, asyncio.get_running_loop(), backend)
    keys = [CacheEngineKey("kvstore-test", 1, 0, 1000 + i, torch.bfloat16) for i in range(chunks)]
    shape = torch.Size(CHUNK_SHAPE)
    out = {"chunks": chunks, "missing": 0, "equal": 0}
    out["exists_before"] = sum([await conn.exists(k) for k in keys])
    sent = []
    for i, key in enumerate(keys):
        obj = backend.allocate(shape, torch.bfloat16)
        obj.tensor.copy_(torch.randn(shape, generator=torch.Generator().manual_seed(i))
                         .to(torch.bfloat16))
        sent.append(obj.tensor.clone())
        await conn.put(key, obj)
    out["exists_after"] = sum([await conn.exists(k) for k in keys])
    for key, want in zip(keys, sent):
        got = await conn.get(key)
        if got is None:
            out["missing"] += 1
        elif torch.equal(got.tensor.view(torch.bfloat16).reshape(shape), want):
            out["equal"] += 1
    return out        # no conn.close(): run on its own loop it waits for that loop (0.5.6)


if __name__ == "__main__":
    faulthandler.dump_traceback_later(120, exit=True)    # a hang shows where, then fails
    loop = asyncio.new_event_loop()
    print(json.dumps(loop.run_until_complete(
        main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4))), flush=True)
    os._exit(0)       # LMCache's executor threads are not ours to join
