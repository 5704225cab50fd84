"""Service metrics: Prometheus series in the server's own registry, and GetStats read back from
the same series (one set of figures, two views)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .. import rpc
from ..generation import mean_acceptance_length

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
LATENCY_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class Metrics:
    def __init__(self, max_k: int):
        self.max_k = max_k
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.engine_steps = Counter("verifier_engine_steps", "engine batches run", registry=r)
        self.steps = Counter("verifier_steps", "session steps verified (OK results)", registry=r)
        self.rows = Counter("verifier_rows", "verify rows run", registry=r)
        self.drafts = Counter("verifier_drafts", "steps that carried at least one draft", registry=r)
        self.draft_tokens = Counter("verifier_draft_tokens", "draft tokens verified", registry=r)
        self.accepted_tokens = Counter("verifier_accepted_tokens", "draft tokens accepted", registry=r)
        self.drafted_at = Counter("verifier_drafted_per_position", "drafts that reached 1-based draft position",
                                  ["position"], registry=r)
        self.accepted_at = Counter("verifier_accepted_per_position", "drafts accepted at 1-based draft position",
                                   ["position"], registry=r)
        self.errors = Counter("verifier_step_errors", "step results with a non-OK status", ["code"], registry=r)
        self.open_errors = Counter("verifier_open_session_errors", "failed OpenSession calls", ["code"], registry=r)
        self.rows_per_batch = Histogram("verifier_rows_per_batch", "verify rows per engine batch", buckets=ROW_BUCKETS, registry=r)
        self.step_latency = Histogram("verifier_step_latency_seconds", "a session step from arrival to result",
                                      buckets=LATENCY_BUCKETS_S, registry=r)
        self.open_sessions = Gauge("verifier_open_sessions", "sessions holding a slot", registry=r)
        self.free_slots = Gauge("verifier_free_slots", "slots free for OpenSession", registry=r)
        for position in range(1, max_k + 1):  # every position shows, at zero, before its first draft
            self.drafted_at.labels(str(position))
            self.accepted_at.labels(str(position))

    def watch_sessions(self, table) -> None:
        self.open_sessions.set_function(lambda: len(table))
        self.free_slots.set_function(lambda: table.free_slots)

    def record_batch(self, rows: int) -> None:
        self.engine_steps.inc()
        self.rows.inc(rows)
        self.rows_per_batch.observe(rows)

    def record_step(self, drafted: int, accepted: int, latency_s: float) -> None:
        self.steps.inc()
        self.step_latency.observe(latency_s)
        if drafted:
            self.drafts.inc()
            self.draft_tokens.inc(drafted)
            self.accepted_tokens.inc(accepted)
            for position in range(1, drafted + 1):
                self.drafted_at.labels(str(position)).inc()
            for position in range(1, accepted + 1):
                self.accepted_at.labels(str(position)).inc()

    def record_error(self, code_name: str) -> None:
        self.errors.labels(code_name).inc()

    def record_open_error(self, code_name: str) -> None:
        self.open_errors.labels(code_name).inc()

    def stats(self) -> rpc.Stats:
        drafts, accepted = _value(self.drafts), _value(self.accepted_tokens)
        return rpc.Stats(
            engine_steps=_value(self.engine_steps),
            steps=_value(self.steps),
            rows=_value(self.rows),
            drafts=drafts,
            draft_tokens=_value(self.draft_tokens),
            accepted_tokens=accepted,
            drafted_per_position=[_value(self.drafted_at.labels(str(p))) for p in range(1, self.max_k + 1)],
            accepted_per_position=[_value(self.accepted_at.labels(str(p))) for p in range(1, self.max_k + 1)],
            mean_acceptance_length=mean_acceptance_length(accepted, drafts),
            rows_per_batch=_histogram(self.rows_per_batch, 1.0),
            step_latency_ms=_histogram(self.step_latency, 1000.0),
            open_sessions=_gauge(self.open_sessions),
            free_slots=_gauge(self.free_slots),
            errors=sum(int(s.value) for m in self.errors.collect() for s in m.samples if s.name.endswith("_total")),
        )


def _value(counter) -> int:
    (metric,) = counter.collect()
    return int(next(s.value for s in metric.samples if s.name.endswith("_total")))


def _gauge(gauge) -> int:
    (metric,) = gauge.collect()
    return int(metric.samples[0].value)


def _histogram(histogram, scale: float) -> rpc.Histogram:
    """Prometheus' cumulative buckets -> rpc.Histogram's per-bucket counts (last bucket: +inf)."""
    (metric,) = histogram.collect()
    bounds, cumulative, total, count = [], [], 0.0, 0
    for sample in metric.samples:
        if sample.name.endswith("_bucket"):
            bounds.append(float(sample.labels["le"]))
            cumulative.append(int(sample.value))
        elif sample.name.endswith("_sum"):
            total = sample.value
        elif sample.name.endswith("_count"):
            count = int(sample.value)
    counts = [c - prev for c, prev in zip(cumulative, [0, *cumulative[:-1]])]
    return rpc.Histogram(upper_bounds=[b * scale for b in bounds[:-1]], counts=counts, sum=total * scale, count=count)
