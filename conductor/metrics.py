"""The conductor's metrics (``--metrics-port``; names in kvstore.metrics' conventions).

    kvstore_requests_total{op,code}, kvstore_request_duration_seconds{op}   every gRPC call
    kvstore_prefix_hit_tokens_total      prompt tokens served from the prefix cache
    kvstore_prompt_tokens_total          prompt tokens of the requests that reached prefill
    kvstore_ttft_seconds                 time to first token, from arrival at the conductor (s)
    kvstore_tbt_seconds                  time between tokens: each gap of a decode stream (s)
    kvstore_requests_rejected_total{reason}   refused: no_instance, ttft_slo, tbt_slo,
                                              kv_capacity, invalid (kvstore.conductor.instances)
    kvstore_generations_total{outcome}   requests ended: completed, rejected, failed
    kvstore_queue_depth{instance}        requests queued on (prefill) or decoding at (decode)
                                         each engine instance, as the scheduler counts them

Observed per request or per token on the conductor's event loop, with
prometheus-client's instruments.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from kvstore.metrics import ProcessMetrics, gauge

#: Seconds: TTFT from 10 ms to 2 min, TBT from 1 ms to 10 s.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)
TBT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5, 10.0)
REJECT_REASONS = ("no_instance", "ttft_slo", "tbt_slo", "kv_capacity", "invalid")


class ConductorMetrics:
    """The conductor's instruments on ``metrics``' registry.

    Args:
        metrics: the process's registry.
        scheduler: a :class:`kvstore.conductor.scheduler.Scheduler` (queue depths,
            read at scrape time on the caller's thread: ints only).
    """

    def __init__(self, metrics: ProcessMetrics, scheduler):
        r = metrics.registry
        self.hit_tokens = Counter("kvstore_prefix_hit_tokens",
                                  "Prompt tokens served from the prefix cache.", registry=r)
        self.prompt_tokens = Counter("kvstore_prompt_tokens",
                                     "Prompt tokens of the requests that reached prefill.",
                                     registry=r)
        self.ttft = Histogram("kvstore_ttft_seconds", "Time to first token (s).",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tbt = Histogram("kvstore_tbt_seconds", "Time between tokens (s).",
                             buckets=TBT_BUCKETS, registry=r)
        self.rejected = Counter("kvstore_requests_rejected", "Requests refused, by reason.",
                                ["reason"], registry=r)
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)
        self.outcomes = Counter("kvstore_generations", "Requests ended, by outcome.",
                                ["outcome"], registry=r)
        for outcome in ("completed", "rejected", "failed"):
            self.outcomes.labels(outcome)

        def depths():
            rows = [({"instance": p.instance_id}, p.queued_requests) for p in scheduler.prefill]
            rows += [({"instance": d.instance_id}, d.active_requests) for d in scheduler.decode]
            return [gauge("kvstore_queue_depth",
                          "Requests queued at (prefill) or decoding on (decode) an instance.",
                          samples=rows)]
        metrics.collect(depths)
