"""Service metrics: Prometheus series in the server's own registry, and GetStats read back from
the same series (one set of figures, two views)."""

from __future__ import annotations

import bisect
import itertools

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import HistogramMetricFamily

from .. import rpc
from ..generation import mean_acceptance_length

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
LATENCY_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class BatchHistogram:
    """A Prometheus histogram fed a batch's observations at once, on the event loop, with no lock
    (prometheus_client's Histogram takes a lock and walks its buckets per value). Exposed like a
    Histogram: NAME_bucket{le=...}, NAME_sum, NAME_count."""

    def __init__(self, name: str, documentation: str, buckets, registry: CollectorRegistry):
        self.name, self.documentation = name, documentation
        self.bounds = [float(b) for b in buckets]  # upper bounds; a last bucket is +inf
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        registry.register(self)

    def observe_many(self, values) -> None:
        counts = list(self.counts)  # replaced whole: a scrape on another thread reads one or the other
        for value in values:
            counts[bisect.bisect_left(self.bounds, value)] += 1  # a value equal to a bound is in it ("le")
        self.counts, self.sum = counts, self.sum + sum(values)

    def observe(self, value: float) -> None:
        self.observe_many([value])

    def collect(self):
        counts, total = self.counts, self.sum  # read once: a scrape runs on another thread
        bounds = [*(repr(b) for b in self.bounds), "+Inf"]
        family = HistogramMetricFamily(self.name, self.documentation)
        family.add_metric([], list(zip(bounds, itertools.accumulate(counts))), sum_value=total)
        yield family


class Metrics:
    def __init__(self, max_k: int):
        self.max_k = max_k
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.engine_steps = Counter("verifier_engine_steps", "engine batches run", registry=r)
        self.engine_seconds = Counter("verifier_engine_seconds", "wall time of the engine steps, on the engine's thread",
                                      registry=r)
        self.steps = Counter("verifier_steps", "session steps verified (OK results)", registry=r)
        self.rows = Counter("verifier_rows", "verify rows run", registry=r)
        self.drafts = Counter("verifier_drafts", "steps that carried at least one draft", registry=r)
        self.draft_tokens = Counter("verifier_draft_tokens", "draft tokens verified", registry=r)
        self.trimmed_drafts = Counter("verifier_trimmed_drafts", "draft tokens sent but not verified (goodput-aware K)",
                                      registry=r)
        self.graph_captures = Counter("verifier_graph_captures", "CUDA graphs the engine captured (startup included)",
                                      registry=r)
        self._captures_seen = 0
        self.accepted_tokens = Counter("verifier_accepted_tokens", "draft tokens accepted", registry=r)
        self.drafted_at = Counter("verifier_drafted_per_position", "drafts that reached 1-based draft position",
                                  ["position"], registry=r)
        self.accepted_at = Counter("verifier_accepted_per_position", "drafts accepted at 1-based draft position",
                                   ["position"], registry=r)
        self.errors = Counter("verifier_step_errors", "step results with a non-OK status", ["code"], registry=r)
        self.open_errors = Counter("verifier_open_session_errors", "failed OpenSession calls", ["code"], registry=r)
        self.rows_per_batch = BatchHistogram("verifier_rows_per_batch", "verify rows per engine batch", ROW_BUCKETS, r)
        self.step_latency = BatchHistogram("verifier_step_latency_seconds", "a session step from arrival to result",
                                           LATENCY_BUCKETS_S, r)
        self.prompt_rows = Counter("verifier_prompt_rows", "prompt rows prefilled, by where: inside a step (--step-prompt-rows) "
                                   "or in a turn of their own", ["where"], registry=r)
        for where in ("step", "turn"):
            self.prompt_rows.labels(where)
        self.open_sessions = Gauge("verifier_open_sessions", "sessions holding a slot", registry=r)
        self.free_slots = Gauge("verifier_free_slots", "slots free for OpenSession", registry=r)
        for position in range(1, max_k + 1):  # every position shows, at zero, before its first draft
            self.drafted_at.labels(str(position))
            self.accepted_at.labels(str(position))

    def watch_sessions(self, table) -> None:
        self.open_sessions.set_function(lambda: len(table))
        self.free_slots.set_function(lambda: table.free_slots)

    def watch_prefix_cache(self, stats) -> None:
        """The engine's prefix cache (its CacheStats, read at each scrape: counts since start, bytes now)."""
        for field, text in (("hits", "opens that restored a cached prompt prefix"), ("misses", "opens that found none"),
                            ("evictions", "cached chunks dropped for the budget (--prefix-cache-gb)"),
                            ("cached_tokens", "prompt tokens restored instead of computed"),
                            ("bytes", "bytes the cached prefixes hold now")):
            gauge = Gauge(f"verifier_prefix_cache_{field}", text, registry=self.registry)
            gauge.set_function(lambda field=field: getattr(stats, field))

    def record_batch(self, rows: int, seconds: float) -> None:
        """An engine batch of `rows` verify rows that took `seconds` on the engine's thread."""
        self.engine_steps.inc()
        self.engine_seconds.inc(seconds)
        self.rows.inc(rows)
        self.rows_per_batch.observe(rows)

    def record_graph_captures(self, total: int) -> None:
        """The engine's capture count since it was built (the counter follows it)."""
        if total != self._captures_seen:
            self.graph_captures.inc(total - self._captures_seen)
            self._captures_seen = total

    def record_steps(self, verified: list[int], trimmed: int, accepted: list[int], latencies_s: list[float]) -> None:
        """A batch's OK steps: per step the drafts verified, the drafts accepted and the latency from
        arrival to result (seconds), and the batch's trimmed drafts. Counters and histograms move
        once per batch, not per step: per-step calls into prometheus_client were a visible share
        of the server's time per step."""
        if not verified:
            return
        self.steps.inc(len(verified))
        self.step_latency.observe_many(latencies_s)
        if trimmed:
            self.trimmed_drafts.inc(trimmed)
        if not any(verified):  # plain decoding: no draft counts to move
            return
        drafted = np.asarray(verified)
        with_drafts = drafted > 0
        drafts = int(with_drafts.sum())
        if not drafts:
            return
        kept = np.asarray(accepted)[with_drafts]
        self.drafts.inc(drafts)
        self.draft_tokens.inc(int(drafted.sum()))
        self.accepted_tokens.inc(int(kept.sum()))
        # a step with d drafts reached positions 1..d and was accepted at 1..a: suffix sums of
        # "ended at d" give "reached p"
        reached = np.cumsum(np.bincount(drafted[with_drafts], minlength=self.max_k + 1)[::-1])[::-1]
        ended = np.cumsum(np.bincount(kept, minlength=self.max_k + 1)[::-1])[::-1]
        for position in range(1, self.max_k + 1):
            if reached[position]:
                self.drafted_at.labels(str(position)).inc(int(reached[position]))
            if ended[position]:
                self.accepted_at.labels(str(position)).inc(int(ended[position]))

    def record_prompt_rows(self, where: str, rows: int) -> None:
        """Prompt rows a job prefilled: where is "step" (inside a step) or "turn" (a turn of their own)."""
        if rows:
            self.prompt_rows.labels(where).inc(rows)

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
            graph_captures=_value(self.graph_captures),
            trimmed_drafts=_value(self.trimmed_drafts),
            engine_seconds=_total(self.engine_seconds),
            errors=sum(int(s.value) for m in self.errors.collect() for s in m.samples if s.name.endswith("_total")),
        )


def _total(counter) -> float:
    (metric,) = counter.collect()
    return next(s.value for s in metric.samples if s.name.endswith("_total"))


def _value(counter) -> int:
    return int(_total(counter))


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
