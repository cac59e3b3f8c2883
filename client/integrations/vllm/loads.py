"""Block loads of the vLLM connector, synchronous or overlapped with the model's steps.

A load reads a request's block objects from the store into the rows of a
host buffer (:mod:`kvstore.client.integrations.vllm.staging`), then copies
each row into the request's blocks of vLLM's KV tensors. The read is the
slow part (the store's transfer); the copy is one memcpy (or DMA) per layer
slice. With ``load_async`` (the extra config) the read runs on a
:class:`Loader` thread while the engine goes on stepping the other requests,
and the copy runs on the engine thread once the read is done, so vLLM's KV
tensors are only ever touched by the engine thread::

    step k     scheduler: the lookup hits n blocks -> get_num_new_matched_tokens
               returns (n * block_size, True); vLLM allocates the blocks and parks
               the request in WAITING_FOR_REMOTE_KVS; the step's metadata carries
               the load. worker: the forward of the other requests, then
               start_load_kv submits the read to the Loader and returns.
    k+1 ..     Loader thread: batch_get_into the host rows. The engine steps on;
               each step's get_finished polls the Loader.
    step m     get_finished: the read is done; the engine thread copies the rows
               into vLLM's blocks, reports the request in finished_recving and
               the blocks that failed in get_block_ids_with_load_errors (the same
               pass, as vLLM requires).
    step m+1   the scheduler schedules the request from its loaded prefix (under
               kv_load_failure_policy "recompute": from its first failed block;
               under "fail": vLLM finishes it with an error).

Without ``load_async`` the read and the copy both run in ``start_load_kv``,
before the forward that needs the blocks (:meth:`LoadJob.read` inline).

Thread safety: a :class:`LoadJob` belongs to the Loader thread from
:meth:`Loader.submit` until :meth:`Loader.take_done` hands it back, then to the
engine thread. The Loader's own lists are guarded by its lock.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from kvstore.client.integrations.vllm.staging import (BlockLayout, HostBuffers, copies_done,
                                                    copy_between, rows)

log = logging.getLogger("vllm.kvstore_connector")

#: ``read(keys, dests) -> per key the bytes read or the error`` (``KVClient.batch_get_into``).
ReadFn = Callable[[list[str], Sequence[torch.Tensor]], list]


@dataclass(slots=True)
class LoadJob:
    """One request's blocks to load, and what the read gave."""

    req_id: str
    keys: list[str]                     # the blocks' store keys, in block order
    block_ids: list[int]                # vLLM's block id of each key
    buf: torch.Tensor | None = None     # host buffer from HostBuffers; given back by the owner
    objects: torch.Tensor | None = None  # [blocks, object_bytes] uint8 view of buf
    results: list = field(default_factory=list)  # per block: bytes read (int) or the error
    read_s: float = 0.0                 # seconds the read took (the store's transfer)
    done_at: float = 0.0                # time.perf_counter() when the read finished

    def read(self, read: ReadFn, host: HostBuffers, object_bytes: int) -> None:
        """Read every block's object into a row of a host buffer; never raises (a
        failure of the whole read becomes every block's error)."""
        t0 = time.perf_counter()
        try:
            self.buf = host.take(len(self.keys) * object_bytes)
            self.objects = rows(self.buf, len(self.keys), object_bytes)
            self.results = list(read(self.keys, list(self.objects)))
            if len(self.results) != len(self.keys):
                raise RuntimeError(f"{len(self.results)} results for {len(self.keys)} keys")
        except Exception as e:  # noqa: BLE001 - reported per block, never raised into vLLM
            self.results = [e] * len(self.keys)
        self.done_at = time.perf_counter()
        self.read_s = self.done_at - t0

    def copy_in(self, kv_caches: dict[str, torch.Tensor], layout: BlockLayout,
                block_slice: Callable[[torch.Tensor, int], torch.Tensor],
                host: HostBuffers) -> tuple[int, list[tuple[int, BaseException]]]:
        """Copy each object read into its block of every layer (engine thread), one copy
        per layer slice, then give the buffer back; never raises.

        Returns:
            The blocks copied in, and ``(block id, error)`` of each block that was not
            (its read failed, or its size differs from ``layout``).
        """
        loaded, failed, pending = 0, [], False
        for i, (bid, size) in enumerate(zip(self.block_ids, self.results)):
            err = size if isinstance(size, BaseException) else None
            if err is None and size != layout.object_bytes:
                err = ValueError(f"a {size} B object, the layout's are {layout.object_bytes} B")
            if err is None:
                try:
                    obj = self.objects[i]
                    for layer, off, n in zip(kv_caches.values(), layout.offsets, layout.sizes):
                        pending |= copy_between(obj[off:off + n], block_slice(layer, bid),
                                                to_host=False, pinned=host.pin)
                    loaded += 1
                    continue
                except Exception as e:  # noqa: BLE001 - never raised into vLLM
                    err = e
            failed.append((bid, err))
        if self.buf is not None:
            if pending:
                copies_done().synchronize()     # before the buffer is reused
            host.give(self.buf)
            self.buf = self.objects = None
        return loaded, failed


class Loader:
    """Runs :class:`LoadJob` reads on background threads; the engine thread polls.

    Args:
        read: the store's batch read into destinations (see :data:`ReadFn`).
        host: where the jobs' buffers come from (the job's owner gives them back).
        object_bytes: one block's object.
        threads: reads that may run at once (each on its own data connections).
    """

    def __init__(self, read: ReadFn, host: HostBuffers, object_bytes: int, threads: int = 2):
        self._read = read
        self._host = host
        self._object_bytes = object_bytes
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads),
                                        thread_name_prefix="kvstore-load")
        self._lock = threading.Lock()
        self._in_flight: list[LoadJob] = []     # submitted, read not finished
        self._done: list[LoadJob] = []          # read finished, not taken yet

    def submit(self, job: LoadJob) -> None:
        """Start ``job``'s read in the background; returns at once."""
        with self._lock:
            self._in_flight.append(job)
        self._pool.submit(self._run, job)

    def _run(self, job: LoadJob) -> None:
        job.read(self._read, self._host, self._object_bytes)
        with self._lock:
            self._in_flight.remove(job)
            self._done.append(job)

    def take_done(self) -> list[LoadJob]:
        """The jobs whose read finished since the last call (in the order they finished)."""
        with self._lock:
            done, self._done = self._done, []
        return done

    @property
    def in_flight(self) -> int:
        """Jobs whose read has not finished."""
        with self._lock:
            return len(self._in_flight)

    def close(self) -> list[LoadJob]:
        """Wait for every read under way; returns the jobs not taken yet (their buffers
        are the caller's to give back)."""
        self._pool.shutdown(wait=True)
        return self.take_done()
