"""A layer-wise writer that stops mid-value (test_put_parts_writer_dies.py).

Lives in its own module so that ``multiprocessing`` (spawn) can import it
in the child without importing the test module.
"""

from __future__ import annotations

import time


def write_first_layer(master: str, prefer_shm: bool, key: str, layers: int, layer_bytes: int,
                      opened) -> None:
    """Open ``put_parts`` of ``key`` (``layers`` x ``layer_bytes`` B), write its first
    layer, send on ``opened`` whether the value is open, then wait for the test to
    kill (or stop) this process."""
    from kvstore.client import KVClient

    kv = KVClient(master, prefer_shm=prefer_shm)
    w = kv.put_parts([key], [layers * layer_bytes])
    w.write(0, 0, b"\x01" * layer_bytes)
    opened.put(w.is_open(0) or repr(w.results[0]))
    time.sleep(600)                 # parked here, the part open, until the test kills it
