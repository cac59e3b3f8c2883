"""Saving a prefill's KV blocks to the store: after prefill, streamed behind it, or layer-wise.

A prefill produces full KV blocks one block-aligned chunk at a time (see
:mod:`kvstore.engines.model`); each one becomes one immutable store object
``[num_layers, 2, block_tokens, num_kv_heads, head_dim]``. A *saver* moves
them to the store. Modes, chosen by name from :data:`SAVE_MODES`:

* ``sync`` -- collect the blocks and put them in one batch after prefill
  ends. All of the save is on the request's critical path.
* ``streamed`` -- **block-streamed**: a block is queued to a background
  thread as soon as its KV is complete in every layer (the model's
  ``on_block`` callback, after the chunk that ends it); the thread puts
  them, ``min_batch`` blocks at a time, while the model computes the next
  chunks, and the rest (with the partial tail block) when compute ends.
  Blocks that complete while a put is in flight join the next put.
* ``layerwise`` -- **layer-wise**: the blocks a prefill will compute are
  reserved in the store before it starts (placed from a placement grant, one
  batch of shared-memory reservations: :meth:`kvstore.client.KVClient.put_parts`); as the
  model writes each layer's K/V of a block (its ``on_layer`` callback,
  before that layer's attention), a background thread copies that layer
  into the block's reservation and hashes it; blocks whose last layer is in
  are committed together whenever the thread runs out of work. A block
  object is layer-major, so each layer is one contiguous part of it, and
  the object still becomes visible only whole.

Which is faster depends on where compute runs. The overlap hides the
store's round trips, but the saver's own work (checksums, gRPC, copies)
needs the CPU and the GIL too. Measured on the CPU-only tiny model (2 cores
shared with the store processes and other jobs):

* in-process, 30 trace prompts, best of 7 interleaved rounds per request:
  the model's prefill ran 4 % (16-block puts) to 10 % (4-block puts) slower
  beside the saver thread; whole requests took +2 % and +7 % against ``sync``;
* ``kvstore demo --requests 30``, 8 alternating pairs: streamed (16-block
  puts) hid about 60 % of its put time and cut the save time left on the
  critical path from 7-17 to about 5 ms per request, yet the engines'
  prefill totals were 1.4 % higher overall (pairs from -7 % to +11 %).

* ``kvstore demo --requests 30`` once per mode (same machine, same hour):
  exposed save time (on the critical path) sync 190 ms, streamed 166 ms,
  layerwise 94 ms in total; but the engines' prefill totals were 6.1 s,
  6.4 s and 7.5 s: the layer-wise thread's copies, hashes and frames
  compete with the model for the GIL and two cores.

So ``sync`` is the default here; ``streamed`` and ``layerwise`` are for
engines whose compute leaves the CPU idle (GPU kernels, where a layer's KV
is ready while the next layer runs) and for stores that are farther away.

Timeline of one streamed request (``b<i>`` = block i's put)::

    model  | chunk 0 | chunk 1 | chunk 2 | chunk 3 |              (finish)
    saver            | b0        | b1 b2           | b3 tail |
                                                   ^ compute ends
           hidden = put time before compute ends; the rest is exposed

Contract, by side:

* Engine thread (one per worker): :meth:`BlockSaver.begin` a
  :class:`SaveSession` per request, :meth:`SaveSession.submit` each
  complete block (its memory must not change until the session ends),
  :meth:`SaveSession.finish` after compute, and always
  :meth:`SaveSession.abandon` in ``finally`` before freeing the pages (a
  no-op after ``finish``).
* Saver thread (``streamed`` only): calls only the store, and reads only
  the submitted blocks; it never touches the model or the page table.

Thread safety: a session is driven by one engine thread; ``streamed``
hands jobs to its thread through a queue and results back under a lock.
The store client must be thread-safe (:class:`kvstore.client.KVClient` is).
"""

from __future__ import annotations

import abc
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from kvstore.errors import KVStoreError

log = logging.getLogger(__name__)


class BlockStore(Protocol):
    """What a saver needs from the store: :meth:`kvstore.client.KVClient.batch_put`."""

    def batch_put(self, keys: Sequence[str], values: Sequence[Any], *,
                  parents: Sequence[str | None] | None = None) -> list[KVStoreError | None]:
        ...

    def put_parts(self, keys: Sequence[str], sizes_bytes: Sequence[int], *,
                  parents: Sequence[str | None] | None = None) -> Any:
        """Only the layer-wise saver: :meth:`kvstore.client.KVClient.put_parts`."""
        ...


@dataclass(frozen=True, slots=True)
class SaveJob:
    """One object to put.

    ``value`` is typically a KV page ``[num_layers, 2, block_tokens,
    num_kv_heads, head_dim]`` (a view into the engine's cache, not a copy).
    """

    tag: int                 # the caller's id for the result (block index; -1 = tail)
    key: str                 # store key
    value: Any               # bytes-like or contiguous CPU tensor; unchanged until the session ends
    parent: str | None = None  # previous block's key of the prefix chain (eviction hint)


@dataclass(slots=True)
class SaveReport:
    """What a session did. Times are wall-clock milliseconds."""

    mode: str
    results: dict[int, KVStoreError | None]   # per job tag: None = stored (or already present)
    save_ms: float = 0.0     # total time inside store puts
    hidden_ms: float = 0.0   # of save_ms, the part that ran before compute ended
    wait_ms: float = 0.0     # time finish() kept the request waiting
    num_puts: int = 0        # batch puts issued

    @property
    def exposed_ms(self) -> float:
        """Save time after compute ended (on the critical path)."""
        return max(self.save_ms - self.hidden_ms, 0.0)


#: Default ``min_batch`` of the streamed saver (blocks per put): 16-block puts
#: cost the model less CPU than 4-block ones (see the module docstring).
DEFAULT_MIN_BATCH = 16


def hidden_ms(intervals: Sequence[tuple[float, float]], compute_end_s: float) -> float:
    """Milliseconds of ``intervals`` (``(start_s, end_s)``) that lie before ``compute_end_s``."""
    return 1000.0 * sum(max(0.0, min(t1, compute_end_s) - t0) for t0, t1 in intervals)


class SaveSession(abc.ABC):
    """One request's saves. Driven by the engine thread only."""

    @abc.abstractmethod
    def submit(self, job: SaveJob) -> None:
        """Hand over a complete block; it may be put at once or later."""

    def expect(self, jobs: list[SaveJob]) -> None:
        """The full blocks this prefill will compute, before it starts.

        Only layer-wise sessions use it (to reserve them all at once); they
        then take these blocks by :meth:`submit_layer`.
        """

    def submit_layer(self, job: SaveJob, layer: int, num_layers: int) -> None:
        """Layer ``layer`` of an expected block is final (``job.value[layer]``).

        Only layer-wise sessions use it; the block is still :meth:`submit`-ted
        when complete, and a layer-wise session then ignores it.
        """

    @abc.abstractmethod
    def finish(self) -> SaveReport:
        """Compute has ended: put what is left, wait for every put, report.

        Raises:
            Exception: a non-store failure inside the saver (a bug) is re-raised here.
        """

    @abc.abstractmethod
    def abandon(self) -> None:
        """Drop what is not put yet and wait until nothing reads the jobs' memory.

        Safe to call after :meth:`finish` (then a no-op) and more than once.
        """


class BlockSaver(abc.ABC):
    """A save mode: makes a session per request."""

    name: str = "base"
    layered: bool = False    # its sessions take layers (SaveSession.submit_layer)

    @abc.abstractmethod
    def begin(self) -> SaveSession:
        """A session for one request."""

    def close(self) -> None:
        """Stop any background thread (after the last session)."""


def _put(store: BlockStore, jobs: list[SaveJob]) -> list[KVStoreError | None]:
    """One batch put; a store error that fails the whole batch is every job's result."""
    try:
        return store.batch_put([j.key for j in jobs], [j.value for j in jobs],
                               parents=[j.parent for j in jobs])
    except KVStoreError as err:
        return [err] * len(jobs)


# ---- sync ------------------------------------------------------------------

class SyncSaver(BlockSaver):
    """Every put after compute: one batch per request.

    Args:
        store: the store client.
    """

    name = "sync"

    def __init__(self, store: BlockStore):
        self.store = store

    def begin(self) -> SaveSession:
        return _SyncSession(self)


class _SyncSession(SaveSession):
    def __init__(self, saver: SyncSaver):
        self._saver = saver
        self._jobs: list[SaveJob] = []

    def submit(self, job: SaveJob) -> None:
        self._jobs.append(job)

    def finish(self) -> SaveReport:
        jobs, self._jobs = self._jobs, []
        report = SaveReport(mode=SyncSaver.name, results={})
        if jobs:
            t0 = time.perf_counter()
            res = _put(self._saver.store, jobs)
            report.save_ms = report.wait_ms = (time.perf_counter() - t0) * 1000
            report.num_puts = 1
            report.results = {j.tag: r for j, r in zip(jobs, res)}
        return report

    def abandon(self) -> None:
        self._jobs = []


# ---- streamed ----------------------------------------------------------------

@dataclass(eq=False, slots=True)
class _Flush:
    """Queue marker: everything before it in the queue is done once ``done`` is set."""

    session: "_StreamedSession"
    done: threading.Event = field(default_factory=threading.Event)


class _ThreadedSaver(BlockSaver):
    """A saver whose puts run on one background thread fed by a FIFO queue
    (so a _Flush is handled only after every item queued before it)."""

    def __init__(self, store: BlockStore, thread_name: str):
        self.store = store
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    @abc.abstractmethod
    def _run(self) -> None:
        """The thread: take items until None."""

    def _take(self) -> list:
        """Block for the next item, then take every item already queued."""
        items = [self._queue.get()]
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                return items


class StreamedSaver(_ThreadedSaver):
    """Block-streamed saves on one background thread (see the module docstring).

    Args:
        store: the store client (shared with the engine thread; must be thread-safe).
        min_batch: jobs to gather before a put (fewer only when the session
            finishes). Each put costs two master round trips whatever its
            size, so putting every block alone spends CPU that the model
            could use; see DEFAULT_MIN_BATCH.
        max_batch: most jobs in one put.
    """

    name = "streamed"

    def __init__(self, store: BlockStore, min_batch: int = 0, max_batch: int = 64):
        self.min_batch = max(1, min_batch or DEFAULT_MIN_BATCH)
        self.max_batch = max(self.min_batch, max_batch)
        # Items: (session, SaveJob) | _Flush | None (stop).
        super().__init__(store, "kv-saver")

    def begin(self) -> SaveSession:
        return _StreamedSession(self)

    # -- saver thread --

    def _run(self) -> None:
        pending: list[tuple[_StreamedSession, SaveJob]] = []
        while True:
            for item in self._take():
                if item is None:
                    self._put_pending(pending)
                    return
                if isinstance(item, _Flush):
                    self._put_pending(pending)
                    pending = []
                    item.done.set()
                    continue
                pending.append(item)
                if len(pending) >= self.max_batch:
                    self._put_pending(pending)
                    pending = []
            if len(pending) >= self.min_batch:
                self._put_pending(pending)
                pending = []

    def _put_pending(self, pending: list[tuple["_StreamedSession", SaveJob]]) -> None:
        by_session: dict[int, tuple[_StreamedSession, list[SaveJob]]] = {}
        for session, job in pending:
            if not session.cancelled:
                by_session.setdefault(id(session), (session, []))[1].append(job)
        for session, jobs in by_session.values():
            t0 = time.perf_counter()
            try:
                res = _put(self.store, jobs)
            except Exception as exc:   # a bug: hand it to the engine thread at finish()
                log.exception("saver thread failed")
                session.record(jobs, [None] * len(jobs), t0, time.perf_counter(), exc)
                continue
            session.record(jobs, res, t0, time.perf_counter(), None)


class _StreamedSession(SaveSession):
    mode = StreamedSaver.name

    def __init__(self, saver: "StreamedSaver | LayerwiseSaver"):
        self._saver = saver
        self._layered: set[int] = set()   # layer-wise: tags that arrive by layers
        self._lock = threading.Lock()
        self._results: dict[int, KVStoreError | None] = {}
        self._intervals: list[tuple[float, float]] = []
        self._failure: BaseException | None = None
        self._open = True
        self.cancelled = False   # read by the saver thread: skip this session's jobs

    def submit(self, job: SaveJob) -> None:
        if not self._open:
            raise RuntimeError("submit after the save session ended")
        self._saver._queue.put((self, job))

    def record(self, jobs: list[SaveJob], res: list[KVStoreError | None], t0: float, t1: float,
               failure: BaseException | None, timed: bool = True) -> None:
        """Saver thread: store one put's outcome (and its interval, when ``timed``)."""
        with self._lock:
            if timed:
                self._intervals.append((t0, t1))
            for j, r in zip(jobs, res):
                self._results[j.tag] = r
            if failure is not None and self._failure is None:
                self._failure = failure

    def _drain(self) -> None:
        flush = _Flush(self)
        self._saver._queue.put(flush)
        if not self._saver._thread.is_alive():
            raise RuntimeError("the saver thread is not running")
        flush.done.wait()

    def finish(self) -> SaveReport:
        compute_end = time.perf_counter()
        self._open = False
        self._drain()
        wait_ms = (time.perf_counter() - compute_end) * 1000
        with self._lock:
            if self._failure is not None:
                raise self._failure
            return SaveReport(
                mode=self.mode, results=dict(self._results),
                save_ms=1000.0 * sum(t1 - t0 for t0, t1 in self._intervals),
                hidden_ms=hidden_ms(self._intervals, compute_end), wait_ms=wait_ms,
                num_puts=len(self._intervals))

    def abandon(self) -> None:
        if not self._open:
            return
        self._open = False
        self.cancelled = True
        if self._saver._thread.is_alive():
            self._drain()   # a put in flight still reads the pages: wait for it


# ---- layerwise ---------------------------------------------------------------

class LayerwiseSaver(_ThreadedSaver):
    """Layer-wise saves: each layer of a block goes to the store as soon as the
    model has written it (see the module docstring), on one background thread.

    Per request: :meth:`SaveSession.expect` names the blocks the prefill will
    compute, and the thread opens one :class:`kvstore.client.parts.PartsWriter` for
    all of them (placed from a placement grant, one batch of reservations on
    the target nodes). Each layer the model reports is copied into its block's
    reservation at once; blocks whose last layer is in are committed
    together whenever the thread runs out of work (so commits batch up
    while the model is busy), the rest when the session finishes. A block
    submitted whole and not expected (the partial tail) is put whole.

    Args:
        store: the store client (thread-safe; it needs ``put_parts``).
    """

    name = "layerwise"
    layered = True

    def __init__(self, store: BlockStore):
        # Items: ("expect", session, jobs) | ("layer", session, tag, layer, num_layers)
        # | ("whole", session, job) | _Flush | None (stop).
        super().__init__(store, "kv-saver-layerwise")

    def begin(self) -> SaveSession:
        return _LayerwiseSession(self)

    # -- saver thread --

    def _run(self) -> None:
        open_: dict[int, _OpenParts] = {}     # id(session) -> its writer
        while True:
            for item in self._take():
                if item is None:
                    for parts in open_.values():
                        parts.writer.abort()
                    return
                if isinstance(item, _Flush):
                    parts = open_.pop(id(item.session), None)
                    if parts is not None:
                        self._guard(item.session, parts.jobs, lambda p=parts: p.close())
                    item.done.set()
                    continue
                kind, session = item[0], item[1]
                if session.cancelled:
                    continue
                if kind == "expect":
                    jobs = item[2]
                    self._guard(session, jobs, lambda s=session, j=jobs: open_.__setitem__(
                        id(s), _OpenParts(s, self.store, j)))
                elif kind == "layer":
                    parts = open_.get(id(session))
                    if parts is not None:
                        self._guard(session, [], lambda p=parts, it=item: p.layer(*it[2:]))
                else:
                    job = item[2]
                    self._guard(session, [job], lambda s=session, j=job: s.record(
                        [j], _put(self.store, [j]), 0.0, 0.0, None, timed=False))
            for parts in open_.values():
                if parts.complete:
                    self._guard(parts.session, [], parts.commit_complete)

    @staticmethod
    def _guard(session: "_LayerwiseSession", jobs: list[SaveJob], step) -> None:
        """Run one step of the thread, timed into the session; a bug goes to finish()."""
        t0 = time.perf_counter()
        try:
            step()
        except Exception as exc:
            log.exception("layer-wise saver thread failed")
            session.record(jobs, [None] * len(jobs), t0, time.perf_counter(), exc)
            return
        session.record([], [], t0, time.perf_counter(), None)


class _OpenParts:
    """Saver thread: one session's PartsWriter and which of its blocks are complete."""

    def __init__(self, session: "_LayerwiseSession", store: BlockStore, jobs: list[SaveJob]):
        self.session = session
        self.jobs = jobs
        self.index = {j.tag: i for i, j in enumerate(jobs)}
        self.writer = store.put_parts([j.key for j in jobs], [_nbytes(j.value) for j in jobs],
                                      parents=[j.parent for j in jobs])
        self.complete: list[int] = []     # written in full, not committed yet
        self.closed: set[int] = set()     # results recorded

    def layer(self, tag: int, value: Any, layer: int, num_layers: int) -> None:
        i = self.index[tag]
        part = value[layer]
        self.writer.write(i, layer * _nbytes(part), part)
        if layer == num_layers - 1:
            self.complete.append(i)

    def commit_complete(self) -> None:
        done, self.complete = self.complete, []
        self._record(done, self.writer.commit(done))

    def close(self) -> None:
        """Session end: commit what is complete, give up the rest."""
        self.commit_complete()
        self.writer.abort()
        self._record([i for i in range(len(self.jobs)) if i not in self.closed],
                     self.writer.results)

    def _record(self, idx: list[int], results: list) -> None:
        res = [results[i] for i in idx]
        self.closed.update(idx)
        self.session.record([self.jobs[i] for i in idx],
                            [r if isinstance(r, KVStoreError) else None for r in res],
                            0.0, 0.0, None, timed=False)


def _nbytes(value: Any) -> int:
    """Bytes of a tensor or buffer."""
    if hasattr(value, "element_size"):
        return value.numel() * value.element_size()
    return memoryview(value).nbytes


class _LayerwiseSession(_StreamedSession):
    """A streamed session whose blocks arrive layer by layer (same accounting)."""

    mode = LayerwiseSaver.name

    def expect(self, jobs: list[SaveJob]) -> None:
        if not self._open:
            raise RuntimeError("expect after the save session ended")
        self._layered.update(j.tag for j in jobs)
        if jobs:
            self._saver._queue.put(("expect", self, list(jobs)))

    def submit(self, job: SaveJob) -> None:
        if not self._open:
            raise RuntimeError("submit after the save session ended")
        if job.tag not in self._layered:
            self._saver._queue.put(("whole", self, job))

    def submit_layer(self, job: SaveJob, layer: int, num_layers: int) -> None:
        if not self._open:
            raise RuntimeError("submit after the save session ended")
        if job.tag in self._layered:
            self._saver._queue.put(("layer", self, job.tag, job.value, layer, num_layers))


#: Save modes by name (``--save-mode``).
SAVE_MODES: dict[str, type[BlockSaver]] = {SyncSaver.name: SyncSaver,
                                           StreamedSaver.name: StreamedSaver,
                                           LayerwiseSaver.name: LayerwiseSaver}
DEFAULT_SAVE_MODE = SyncSaver.name   # measured faster on CPU compute (module docstring)
#: Environment variable that overrides the prefill engine's default ``--save-mode``
#: (lets a launcher such as ``kvstore demo`` pick it without engine options).
SAVE_MODE_ENV = "KVSTORE_SAVE_MODE"


def make_saver(mode: str, store: BlockStore) -> BlockSaver:
    """The saver registered as ``mode``.

    Raises:
        ValueError: no such mode.
    """
    try:
        cls = SAVE_MODES[mode]
    except KeyError:
        raise ValueError(f"unknown save mode {mode!r}; choose from {sorted(SAVE_MODES)}") from None
    return cls(store)
