"""Layer-wise saves of the vLLM connector through the SDK's ``put_parts``.

A block's object is layer-major (:mod:`kvstore.client.integrations.vllm.staging`),
so layer ``l``'s slice of every block is one range of its object. With
``save_mode: "parts"`` (extra config) a step's blocks to save are reserved on
their nodes when the first layer is saved (``KVClient.put_parts``), each
layer's slices are written into the reservations as vLLM's forward produces
them (straight into a same-host node's shared memory: no staging buffer, no
second copy), and the values are committed after the forward, in the
background::

    bind_connector_metadata  begin: put_parts on a lane thread (placement from the
                             grant, SHM_ALLOC on each node) while the first layers run;
                             the first save_kv_layer waits for it if it is not done
    save_kv_layer(layer l)   write layer l's slice of every block (engine thread)
    wait_for_save            commit on the lane thread (SHM_COMMIT; the values become
                             visible once the master applied the nodes' reports)

A writer's reservations belong to the data connection that made them, and a
connection is one thread's (:mod:`kvstore.client.connections`), so a writer
is opened and committed on one lane thread. Lanes take steps in turn, so the
next step's open does not queue behind this step's commit. A slice that is
not a contiguous host tensor (a CUDA tensor, a ``[2, num_blocks, ...]``
layout's K and V) goes through a host buffer first. A layer that comes out of
order is held (a host copy) until the ones before it are in.

Thread safety: :class:`LayerwiseSave` belongs to the engine thread; a step's
writer is touched by its lane thread for open and commit, and by the engine
thread for the writes in between (the futures order the two).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from kvstore.client.client import KVClient
from kvstore.client.integrations.vllm.staging import (BlockLayout, HostBuffers, copies_done,
                                                    copy_between, rows)
from kvstore.client.parts import PartsWriter
from kvstore.errors import KVStoreError


class _Step:
    """One step's layer-wise save."""

    __slots__ = ("keys", "block_ids", "lane", "writer", "next_layer", "held", "error")

    def __init__(self, keys: list[str], block_ids: list[int], lane: ThreadPoolExecutor,
                 writer: Future):
        self.keys = keys
        self.block_ids = block_ids
        self.lane = lane
        self.writer: Future = writer            # -> PartsWriter, made on ``lane``
        self.next_layer = 0                     # layers below this index are written
        self.held: dict[int, torch.Tensor] = {}   # later layers' slices, [blocks, bytes]
        self.error: BaseException | None = None   # nothing of the step is saved


class LayerwiseSave:
    """Opens, fills and commits each step's values (see the module doc).

    Args:
        store: the connector's client (made on first use).
        layout: where each layer lies in a block's object.
        block_slice: ``block_slice(layer_tensor, block_id)``, the block's slice.
        host: staging buffers for slices that cannot be written as they are.
        count: ``count(counter, amount)``, the connector's counters (``saved_blocks``,
            ``save_s``).
        fail: ``fail(what, counter, n, error)``, counts ``n`` failures (``save_errors``).
        dump: writes the counters out (after each commit).
        lanes: threads that open and commit writers, steps in turn.
    """

    def __init__(self, store: Callable[[], KVClient], layout: BlockLayout,
                 block_slice: Callable[[torch.Tensor, int], torch.Tensor], host: HostBuffers,
                 count: Callable, fail: Callable, dump: Callable[[], None], lanes: int = 2):
        self._store = store
        self._count, self._fail, self._dump = count, fail, dump
        self._layout = layout
        self._slice = block_slice
        self._host = host
        self._lanes = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kvstore-parts{i}")
                       for i in range(max(1, lanes))]
        self._turn = 0
        self.step: _Step | None = None

    def begin(self, keys: list[str], block_ids: list[int]) -> None:
        """Reserve this step's values (on the next lane; written by :meth:`layer`)."""
        lane = self._lanes[self._turn % len(self._lanes)]
        self._turn += 1
        sizes = [self._layout.object_bytes] * len(keys)
        self.step = _Step(keys, block_ids, lane,
                          lane.submit(lambda: self._store().put_parts(keys, sizes)))

    def layer(self, name: str, kv_layer: torch.Tensor) -> None:
        """Write layer ``name``'s slice of every block of the step (engine thread);
        a failure marks the step failed, it is never raised."""
        step = self.step
        if step is None or step.error is not None:
            return
        try:
            idx = self._layout.names.index(name)
            if idx != step.next_layer:
                step.held[idx] = self._staged(kv_layer, step.block_ids, idx)
                return
            if not step.writer.done():          # the forward waits for the reservation
                t0 = time.perf_counter()
                step.writer.result()
                self._count("save_wait_s", time.perf_counter() - t0)
            writer: PartsWriter = step.writer.result()
            self._write(writer, step, idx, kv_layer)
            while step.next_layer in step.held:
                self._write_rows(writer, step, step.next_layer, step.held.pop(step.next_layer))
        except Exception as e:  # noqa: BLE001 - never raise into vLLM's forward
            step.error = e

    def _write(self, writer: PartsWriter, step: _Step, idx: int, kv_layer: torch.Tensor) -> None:
        off, size = self._layout.offsets[idx], self._layout.sizes[idx]
        slices = [self._slice(kv_layer, bid) for bid in step.block_ids]
        if all(s.device.type == "cpu" and s.is_contiguous() and type(s) is torch.Tensor
               for s in slices):
            for i, s in enumerate(slices):
                _write_part(writer, i, off, s)  # straight into the node's memory
            step.next_layer += 1
            return
        staged = self._staged(kv_layer, step.block_ids, idx)
        self._write_rows(writer, step, idx, staged)

    def _staged(self, kv_layer: torch.Tensor, block_ids: list[int], idx: int) -> torch.Tensor:
        """Layer ``idx``'s slices of ``block_ids`` copied into a new host tensor
        ``[blocks, slice bytes]``."""
        size = self._layout.sizes[idx]
        buf = self._host.take(len(block_ids) * size)
        try:
            out = rows(buf, len(block_ids), size)
            pending = False
            for row, bid in zip(out, block_ids):
                pending |= copy_between(row, self._slice(kv_layer, bid), to_host=True,
                                        pinned=self._host.pin)
            if pending:
                copies_done().synchronize()
            return out.clone()
        finally:
            self._host.give(buf)

    def _write_rows(self, writer: PartsWriter, step: _Step, idx: int,
                    staged: torch.Tensor) -> None:
        off = self._layout.offsets[idx]
        for i, row in enumerate(staged):
            _write_part(writer, i, off, row)
        step.next_layer = idx + 1

    def finish(self) -> Future | None:
        """End the step: commit its values on their lane, counted (``saved_blocks``: stored
        or equal bytes already there; ``save_errors``); None without a step. The future
        never raises."""
        step, self.step = self.step, None
        if step is None:
            return None
        if step.error is None and step.next_layer != len(self._layout.names):
            step.error = ValueError(f"{len(self._layout.names) - step.next_layer} layers "
                                    "were not saved this step")
        return step.lane.submit(self._commit, step)

    def _commit(self, step: _Step) -> None:
        t0 = time.perf_counter()
        try:
            writer: PartsWriter = step.writer.result()
            if step.error is not None:
                writer.abort()
                raise step.error
            results = writer.commit()
        except Exception as e:  # noqa: BLE001 - counted, never raised into vLLM
            self._fail("save", "save_errors", len(step.keys), e)
            return
        for res in results:
            if isinstance(res, BaseException):
                self._fail("save", "save_errors", 1, res)
            else:
                self._count("saved_blocks", 1)
        self._count("save_s", time.perf_counter() - t0)
        self._dump()

    def close(self) -> None:
        """Finish every lane's work (commits under way)."""
        for lane in self._lanes:
            lane.shutdown(wait=True)


def _write_part(writer: PartsWriter, i: int, offset: int, part: torch.Tensor) -> None:
    """One part of value ``i``; a value that fails (its node's connection closed) has
    the error in ``writer.results`` and takes no more parts, the others go on."""
    try:
        writer.write(i, offset, part)
    except KVStoreError:
        pass
