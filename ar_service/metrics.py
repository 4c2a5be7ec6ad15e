"""ar_service's Prometheus metrics: queue depth, running batch, batch sizes, request counters, decode step time,
repeated prefills kept.

One registry per engine (tests build several engines in one process); ``__main__`` serves it over HTTP
with ``prometheus_client.start_http_server`` when ``metrics_port`` > 0.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class EngineMetrics:
    def __init__(self, max_batch_size: int, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge("ardit_ar_queue_depth", "requests admitted and waiting to start decoding", registry=r)
        self.running = Gauge("ardit_ar_running_streams", "images (decode streams) in the running batch", registry=r)
        buckets = sorted({1, 2, 4, 8, 16, 32, 64, max_batch_size})
        self.batch_size = Histogram(
            "ardit_ar_batch_size", "decode streams per batched decode step", buckets=buckets, registry=r
        )
        self.admitted = Counter("ardit_ar_requests_admitted", "requests admitted to the queue", registry=r)
        self.rejected = Counter("ardit_ar_requests_rejected", "requests refused because the queue was full", registry=r)
        self.cancelled = Counter(
            "ardit_ar_requests_cancelled", "requests that left early (client gone, deadline, downstream failure)", registry=r
        )
        self.completed = Counter("ardit_ar_requests_completed", "requests whose decoding finished", registry=r)
        self.step_seconds = Histogram(
            "ardit_ar_decode_step_seconds",
            "wall time of one batched decode token step (sampling, forward, row streaming)",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=r,
        )
        self.decode_forwards = Counter(
            "ardit_ar_decode_forwards", "decode forwards an image stream took part in (by ar_decoding mode)",
            ["decoding"], registry=r,
        )
        self.decoded_tokens = Counter(
            "ardit_ar_decoded_tokens", "visual-grid tokens made final by decode forwards (by ar_decoding mode)",
            ["decoding"], registry=r,
        )
        self.tokens_per_forward = Histogram(
            "ardit_ar_tokens_per_forward", "an image's decoded tokens over its decode forwards (by ar_decoding mode)",
            ["decoding"], buckets=(1, 1.5, 2, 3, 4, 6, 8, 12, 16, 32, 64), registry=r,
        )
        self.prefill_memo = Counter(
            "ardit_ar_prefill_memo_lookups",
            "lookups of a repeated prefill kept by its token ids (kind: negative or unconditional; result: hit or miss)",
            ["kind", "result"],
            registry=r,
        )

    def count_forward(self, decoding: str, committed: int) -> None:
        """One image stream's share of a decode forward, and the tokens it made final."""
        self.decode_forwards.labels(decoding).inc()
        self.decoded_tokens.labels(decoding).inc(committed)

    def count_prefill_memo(self, kind: str, hit: bool) -> None:
        self.prefill_memo.labels(kind, "hit" if hit else "miss").inc()
