"""Prometheus metrics of the eviction step, under SGLang's `--enable-metrics`.

SGLang runs prometheus_client in multiprocess mode: the launcher sets PROMETHEUS_MULTIPROC_DIR
before any process imports prometheus_client, each scheduler writes its metrics there, and the
HTTP server's /metrics merges them. Its SchedulerMetricsCollector is built in
Scheduler.init_metrics_collector, only on the rank that logs stats and only with
--enable-metrics; we build ours right after it, with the same labels, so the series line up
with `sglang:*`:

    vase:evictions_total           request-rounds evicted (one request in one eviction step)
    vase:evicted_tokens_total      tokens evicted per (layer, KV head), summed over requests
    vase:freed_slots_total         KV slots returned to the allocator
    vase:eviction_seconds          histogram of the host wall time of one eviction step (all
                                   requests of the batch): what the scheduler thread spent
    vase:eviction_device_seconds   histogram of the device time of one step (CUDA events read
                                   without a sync, so reported a step or more late; on CPU the
                                   host time): the share of the GPU the step takes
    vase:evictions_by_cause_total  request-rounds by cause: scheduled (budget, or elastic
                                   ceiling, reached), decode_pressure (the next decode step did
                                   not fit), admission_pressure (a waiting request did not)
    vase:elastic_level             the level (tokens kept) elastic requests were last cut to
    vase:elastic_over_floor_tokens tokens running elastic requests hold above their floors
                                   (what pressure may take back), at the last decode step
"""

from __future__ import annotations

TARGET_INIT_COLLECTOR = "sglang.srt.managers.scheduler.Scheduler.init_metrics_collector"

BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
           10.0, 30.0)


class EvictionMetrics:
    def __init__(self, labels: dict):
        # Imported here: prometheus_client must be imported after PROMETHEUS_MULTIPROC_DIR is set.
        from prometheus_client import Counter, Gauge, Histogram

        names = list(labels)
        self.labels = {k: str(v) for k, v in labels.items()}
        self.evictions = Counter("vase:evictions_total",
                                 "Request-rounds evicted (one request in one eviction step).",
                                 labelnames=names)
        self.evicted_tokens = Counter("vase:evicted_tokens_total",
                                      "Tokens evicted per (layer, KV head), summed over requests.",
                                      labelnames=names)
        self.freed_slots = Counter("vase:freed_slots_total",
                                   "KV cache slots returned to the allocator by eviction.",
                                   labelnames=names)
        self.seconds = Histogram("vase:eviction_seconds",
                                 "Wall time of one eviction step (all evicted requests of a batch).",
                                 labelnames=names, buckets=BUCKETS)
        self.device_seconds = Histogram(
            "vase:eviction_device_seconds",
            "Device time of one eviction step (CUDA events, read when finished; CPU: wall time).",
            labelnames=names, buckets=BUCKETS)
        self.by_cause = Counter("vase:evictions_by_cause_total",
                                "Request-rounds evicted, by cause (scheduled, decode_pressure, "
                                "admission_pressure).", labelnames=[*names, "cause"])
        # Gauges in multiprocess mode: the most recent value of any process.
        self.level = Gauge("vase:elastic_level",
                           "Tokens kept by the elastic requests last cut under memory pressure.",
                           labelnames=names, multiprocess_mode="mostrecent")
        self.over_floor = Gauge("vase:elastic_over_floor_tokens",
                                "Tokens running elastic requests hold above their floors.",
                                labelnames=names, multiprocess_mode="mostrecent")

    def record(self, evictions: int, tokens: int, slots: int, seconds: float,
               cause: str = "scheduled") -> None:
        self.by_cause.labels(**self.labels, cause=cause).inc(evictions)
        self.evictions.labels(**self.labels).inc(evictions)
        self.evicted_tokens.labels(**self.labels).inc(tokens)
        self.freed_slots.labels(**self.labels).inc(slots)
        self.seconds.labels(**self.labels).observe(seconds)

    def record_device(self, seconds: float) -> None:
        self.device_seconds.labels(**self.labels).observe(seconds)

    def record_level(self, level: int) -> None:
        self.level.labels(**self.labels).set(level)

    def record_holdings(self, holdings) -> None:
        from vase_sglang.elastic import over_floor

        self.over_floor.labels(**self.labels).set(sum(over_floor(h) for h in holdings))


METRICS: EvictionMetrics | None = None  # set in the scheduler process that exports metrics


def after_init_metrics_collector(result, scheduler):
    """AFTER Scheduler.init_metrics_collector: SGLang's collector exists exactly where metrics
    are exported (--enable-metrics, stats-logging rank)."""
    global METRICS
    collector = getattr(scheduler, "metrics_collector", None)
    if collector is not None and METRICS is None:
        labels = dict(getattr(collector, "labels", {}) or {})
        labels.pop("priority", None)  # a per-request label in SGLang; ours are per step
        METRICS = EvictionMetrics(labels)
    return result


HOOKS = [(TARGET_INIT_COLLECTOR, "AFTER", after_init_metrics_collector)]
