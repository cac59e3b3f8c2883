"""The engines' metrics (``--metrics-port``; names in kvstore.metrics' conventions).

    kvstore_requests_total{op,code}, kvstore_request_duration_seconds{op}   every gRPC call
    kvstore_prefill_tokens_total{source}   prompt tokens prefilled: computed, or loaded
                                           from the store (the prefix cache's gain)
    kvstore_kv_save_seconds                time to save a request's new KV blocks (s)
    kvstore_kv_load_seconds                time to load a request's KV blocks from the store (s)
    kvstore_decode_batch_size              requests in each decode step
    kvstore_engine_queue_depth             requests waiting for this engine

One per request (or decode step) at most, so these use prometheus-client's
own instruments.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from kvstore.metrics import ProcessMetrics, gauge

#: Seconds, for KV saves and loads: 100 us to 10 s.
KV_SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                      0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class EngineMetrics:
    """An engine's instruments on ``metrics``' registry.

    Args:
        metrics: the process's registry.
        queue_depth: returns the requests waiting now (read at scrape time).
    """

    def __init__(self, metrics: ProcessMetrics, queue_depth=lambda: 0):
        r = metrics.registry
        self.prefill_tokens = Counter("kvstore_prefill_tokens",
                                      "Prompt tokens prefilled, computed or loaded from the store.",
                                      ["source"], registry=r)
        self.computed = self.prefill_tokens.labels("computed")
        self.loaded = self.prefill_tokens.labels("loaded")
        self.kv_save = Histogram("kvstore_kv_save_seconds",
                                 "Time to save a request's new KV blocks to the store (s).",
                                 buckets=KV_SECONDS_BUCKETS, registry=r)
        self.kv_load = Histogram("kvstore_kv_load_seconds",
                                 "Time to load a request's KV blocks from the store (s).",
                                 buckets=KV_SECONDS_BUCKETS, registry=r)
        self.decode_batch = Histogram("kvstore_decode_batch_size",
                                      "Requests in each decode step.", buckets=BATCH_BUCKETS,
                                      registry=r)
        metrics.collect(lambda: [gauge("kvstore_engine_queue_depth",
                                       "Requests waiting for this engine.", queue_depth())])
