"""Saving a prefill's KV blocks to the store: after prefill, or streamed behind it.

A prefill produces full KV blocks one block-aligned chunk at a time (see
:mod:`engines.model`); each one becomes one immutable store object
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

So ``sync`` is the default here; ``streamed`` is for engines whose compute
leaves the CPU idle (GPU kernels) and stores that are farther away.

Neither mode is layer-wise: objects are put whole, never as layer-sized
parts. With block-aligned chunks the overlap already has a granularity of
one chunk (all layers of ``block_tokens`` tokens); splitting by layer would
pay off only when one chunk spans many blocks.

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
The store client must be thread-safe (:class:`client.KVClient` is).
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
    """What a saver needs from the store: :meth:`client.KVClient.batch_put`."""

    def batch_put(self, keys: Sequence[str], values: Sequence[Any], *,
                  parents: Sequence[str | None] | None = None) -> list[KVStoreError | None]:
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


class StreamedSaver(BlockSaver):
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
        self.store = store
        self.min_batch = max(1, min_batch or DEFAULT_MIN_BATCH)
        self.max_batch = max(self.min_batch, max_batch)
        # Items: (session, SaveJob) | _Flush | None (stop). FIFO, so a _Flush
        # is handled only after every job queued before it.
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kv-saver", daemon=True)
        self._thread.start()

    def begin(self) -> SaveSession:
        return _StreamedSession(self)

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    # -- saver thread --

    def _run(self) -> None:
        pending: list[tuple[_StreamedSession, SaveJob]] = []
        while True:
            items = [self._queue.get()]
            while True:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            for item in items:
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
    def __init__(self, saver: StreamedSaver):
        self._saver = saver
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
               failure: BaseException | None) -> None:
        """Saver thread: store one put's outcome."""
        with self._lock:
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
                mode=StreamedSaver.name, results=dict(self._results),
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


#: Save modes by name (``--save-mode``).
SAVE_MODES: dict[str, type[BlockSaver]] = {SyncSaver.name: SyncSaver,
                                           StreamedSaver.name: StreamedSaver}
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
