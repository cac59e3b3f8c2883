"""Prefill KV savers (kvstore.engines.kv_saver): sync and block-streamed, without a network.

(The layer-wise saver needs the store's reservations, so it is tested
against a real cluster only.)

The store here is :class:`_MemoryStore`, a plain in-memory implementation of
the saver's one dependency (``batch_put``) that can be told to be slow or to
fail; the real store is exercised in tests/integration/test_prefill_save_modes.py.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvstore.client.models import ModelConfig
from kvstore.engines.kv_cache import PagedKVCache, Sequence
from kvstore.engines.kv_saver import (DEFAULT_SAVE_MODE, SAVE_MODES, LayerwiseSaver, SaveJob,
                              StreamedSaver, SyncSaver, hidden_ms, make_saver)
from kvstore.engines.model import LlamaModel
from kvstore.errors import NoSpace, Unavailable
from waits import wait_until


class _MemoryStore:
    """Keeps a copy of each value; records every batch put with its time."""

    def __init__(self, put_s: float = 0.0, refuse: set[str] = frozenset(), fail_with=None):
        self.put_s = put_s
        self.refuse = set(refuse)
        self.fail_with = fail_with
        self.values: dict[str, bytes] = {}
        self.parents: dict[str, str | None] = {}
        self.calls: list[tuple[float, float, list[str]]] = []   # (start_s, end_s, keys)
        self.threads: set[str] = set()

    def batch_put(self, keys, values, *, parents=None):
        t0 = time.perf_counter()
        self.threads.add(threading.current_thread().name)
        if self.fail_with is not None:
            raise self.fail_with
        out = []
        for k, v, p in zip(keys, values, parents or [None] * len(keys)):
            if k in self.refuse:
                out.append(NoSpace("full", key=k))
                continue
            self.values[k] = bytes(v.numpy().tobytes() if isinstance(v, torch.Tensor) else v)
            self.parents[k] = p
            out.append(None)
        time.sleep(self.put_s)                   # the put's own time (a fake store's latency)
        self.calls.append((t0, time.perf_counter(), list(keys)))
        return out


def _jobs(n: int) -> list[SaveJob]:
    return [SaveJob(i, f"k{i}", bytes([i]) * 8, f"k{i - 1}" if i else None) for i in range(n)]


def test_registry():
    assert set(SAVE_MODES) == {"sync", "streamed", "layerwise"} and DEFAULT_SAVE_MODE in SAVE_MODES
    store = _MemoryStore()
    assert isinstance(make_saver("sync", store), SyncSaver)
    for name, cls in (("streamed", StreamedSaver), ("layerwise", LayerwiseSaver)):
        saver = make_saver(name, store)
        assert isinstance(saver, cls) and saver.layered == (name == "layerwise")
        saver.close()
    with pytest.raises(ValueError, match="layerwise"):
        make_saver("blockwise", store)


def test_hidden_ms_counts_only_time_before_compute_ended():
    assert hidden_ms([], 1.0) == 0.0
    assert hidden_ms([(0.0, 0.5), (0.9, 1.2), (1.1, 1.3)], 1.0) == pytest.approx(600.0)


def test_sync_puts_everything_in_one_batch_at_finish():
    store = _MemoryStore()
    session = SyncSaver(store).begin()
    for job in _jobs(5):
        session.submit(job)
    assert not store.calls                       # nothing before compute ends
    report = session.finish()
    assert len(store.calls) == 1 and store.calls[0][2] == [f"k{i}" for i in range(5)]
    assert report.mode == "sync" and report.num_puts == 1
    assert report.results == dict.fromkeys(range(5))
    assert report.hidden_ms == 0.0 and report.exposed_ms == report.save_ms > 0
    assert store.parents == {f"k{i}": (f"k{i - 1}" if i else None) for i in range(5)}


def test_streamed_puts_while_compute_runs_and_reports_hidden_time():
    store = _MemoryStore(put_s=0.01)
    saver = StreamedSaver(store, min_batch=1)
    try:
        session = saver.begin()
        for job in _jobs(6):
            session.submit(job)
            time.sleep(0.03)                     # "compute" of the next chunk
        compute_end = time.perf_counter()
        report = session.finish()
    finally:
        saver.close()
    assert store.threads == {"kv-saver"}
    assert store.calls[0][0] < compute_end       # the first put ran during compute
    assert report.results == dict.fromkeys(range(6))
    assert [k for _t0, _t1, ks in store.calls for k in ks] == [f"k{i}" for i in range(6)]
    assert report.num_puts == len(store.calls)
    assert report.hidden_ms > 0.5 * report.save_ms
    assert report.hidden_ms + report.exposed_ms == pytest.approx(report.save_ms)


def test_streamed_gathers_min_batch_blocks_per_put():
    store = _MemoryStore()
    saver = StreamedSaver(store, min_batch=3, max_batch=4)
    try:
        session = saver.begin()
        for job in _jobs(8):
            session.submit(job)
            time.sleep(0.005)                    # pacing: blocks arrive as compute makes them
        report = session.finish()
    finally:
        saver.close()
    sizes = [len(ks) for _t0, _t1, ks in store.calls]
    assert sum(sizes) == 8 and all(3 <= n <= 4 for n in sizes[:-1]) and sizes[-1] <= 4
    assert report.results == dict.fromkeys(range(8))


def test_streamed_sessions_run_back_to_back_on_one_thread():
    store = _MemoryStore()
    saver = StreamedSaver(store, min_batch=2)
    try:
        for r in range(3):
            session = saver.begin()
            for i in range(3):
                session.submit(SaveJob(i, f"r{r}/{i}", b"x"))
            assert session.finish().results == dict.fromkeys(range(3))
    finally:
        saver.close()
    assert len(store.values) == 9


@pytest.mark.parametrize("mode", ["sync", "streamed"])
def test_per_key_errors_come_back_by_tag(mode):
    store = _MemoryStore(refuse={"k1", "k3"})
    saver = make_saver(mode, store)
    try:
        session = saver.begin()
        for job in _jobs(4):
            session.submit(job)
        report = session.finish()
    finally:
        saver.close()
    assert report.results[0] is None and report.results[2] is None
    assert isinstance(report.results[1], NoSpace) and isinstance(report.results[3], NoSpace)


@pytest.mark.parametrize("mode", ["sync", "streamed"])
def test_a_store_error_fails_the_batch_not_the_request(mode):
    saver = make_saver(mode, _MemoryStore(fail_with=Unavailable("master down")))
    try:
        session = saver.begin()
        for job in _jobs(3):
            session.submit(job)
        report = session.finish()
    finally:
        saver.close()
    assert all(isinstance(e, Unavailable) for e in report.results.values())


def test_a_bug_in_the_saver_thread_surfaces_at_finish():
    saver = StreamedSaver(_MemoryStore(fail_with=ZeroDivisionError("bug")), min_batch=1)
    try:
        session = saver.begin()
        session.submit(_jobs(1)[0])
        with pytest.raises(ZeroDivisionError):
            session.finish()
        session = saver.begin()   # the thread survives for the next request
        session.abandon()
    finally:
        saver.close()


def test_abandon_waits_for_the_put_in_flight_and_drops_the_rest():
    store = _MemoryStore(put_s=0.1)
    saver = StreamedSaver(store, min_batch=1, max_batch=1)
    try:
        session = saver.begin()
        for job in _jobs(5):
            session.submit(job)
        wait_until(lambda: store.threads, interval_s=0.005, what="the first put to start")
        session.abandon()
        returned = time.perf_counter()
        session.abandon()                        # idempotent
        with pytest.raises(RuntimeError):
            session.submit(_jobs(1)[0])
    finally:
        saver.close()
    assert store.calls and all(t1 <= returned for _t0, t1, _ks in store.calls)
    assert len(store.values) < 5


def test_streamed_blocks_hold_the_final_kv_bytes():
    """A block handed over by on_block never changes afterwards, so what the
    saver thread copies while later chunks compute is the block's final KV."""
    cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
                      rms_norm_eps=1e-6, max_position_embeddings=512,
                      tie_word_embeddings=False, seed=3)
    model = LlamaModel.random(cfg)
    cache = PagedKVCache.for_model(cfg, 32, 8)
    tokens = [(7 * i + 3) % cfg.vocab_size for i in range(8 * 9 + 5)]
    store = _MemoryStore(put_s=0.002)
    saver = StreamedSaver(store, min_batch=1)
    seq = Sequence("s")
    cache.reserve(seq, len(tokens))
    try:
        session = saver.begin()
        model.prefill(seq, cache, tokens, on_block=lambda i, page: session.submit(
            SaveJob(i, f"b{i}", cache.page(page))))
        report = session.finish()
    finally:
        saver.close()
    assert report.results == dict.fromkeys(range(9))
    for i in range(9):
        assert store.values[f"b{i}"] == cache.page(seq.page_ids[i]).numpy().tobytes(), i
