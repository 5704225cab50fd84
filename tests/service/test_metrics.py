"""Service metrics as functions: the batched histogram's buckets and exposition, and the
per-position draft counts a batch adds (GetStats reads both back)."""

from prometheus_client import generate_latest

from verifier.server.metrics import LATENCY_BUCKETS_S, Metrics


def test_a_batch_of_latencies_lands_in_prometheus_buckets():
    metrics = Metrics(max_k=2)
    # 0.001 is a bound: it belongs to that bucket ("le"); 7.0 is past the last bound (+inf)
    metrics.record_steps([0, 0, 0, 0], 0, [0, 0, 0, 0], [0.001, 0.0015, 0.03, 7.0])
    histogram = metrics.stats().step_latency_ms
    assert list(histogram.upper_bounds) == [b * 1000 for b in LATENCY_BUCKETS_S]
    expected = [0] * (len(LATENCY_BUCKETS_S) + 1)
    expected[0] += 1  # 0.001
    expected[1] += 1  # 0.0015 <= 0.002
    expected[LATENCY_BUCKETS_S.index(0.05)] += 1  # 0.03
    expected[-1] += 1  # 7.0
    assert list(histogram.counts) == expected
    assert histogram.count == 4 and abs(histogram.sum - 7032.5) < 1e-9
    text = generate_latest(metrics.registry).decode()
    assert 'verifier_step_latency_seconds_bucket{le="0.001"} 1.0' in text
    assert 'verifier_step_latency_seconds_bucket{le="+Inf"} 4.0' in text
    assert "verifier_step_latency_seconds_count 4.0" in text


def test_draft_counts_by_position():
    metrics = Metrics(max_k=3)
    # steps: 3 drafts, 2 accepted; 1 draft, 0 accepted; no drafts; 2 drafts, 2 accepted; 5 trimmed in all
    metrics.record_steps([3, 1, 0, 2], 5, [2, 0, 0, 2], [0.01] * 4)
    stats = metrics.stats()
    assert (stats.steps, stats.drafts, stats.draft_tokens, stats.accepted_tokens, stats.trimmed_drafts) == (4, 3, 6, 4, 5)
    assert list(stats.drafted_per_position) == [3, 2, 1]  # position 1: three steps reached it; 3: one
    assert list(stats.accepted_per_position) == [2, 2, 0]
    metrics.record_batch(9, 0.25)
    assert stats.rows_per_batch.count == 0 and metrics.stats().rows_per_batch.count == 1
    metrics.record_batch(3, 0.5)
    assert metrics.stats().engine_seconds == 0.75


def _get(port: int, token: str | None = None) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_the_endpoint_asks_for_its_token():
    from verifier.server.metrics_http import MetricsEndpoint

    metrics = Metrics(max_k=2)
    endpoint = MetricsEndpoint(metrics.registry, "127.0.0.1", 0, token="scrape-me")
    port = endpoint.start()
    try:
        assert _get(port)[0] == 401 and _get(port, "wrong")[0] == 401
        status, body = _get(port, "scrape-me")
        assert status == 200 and b"verifier_steps_total" in body
    finally:
        endpoint.stop()


def test_idle_connections_hold_a_bounded_number_of_threads():
    """Connections that never send a request take at most MAX_HANDLERS threads; the rest are closed
    at once, and once the silent ones time out a scrape is answered again."""
    import socket
    import threading
    import time

    from verifier.server import metrics_http

    metrics = Metrics(max_k=2)
    endpoint = metrics_http.MetricsEndpoint(metrics.registry, "127.0.0.1", 0)
    port = endpoint.start()
    before = threading.active_count()
    silent = []
    try:
        for _ in range(40):
            silent.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(0.5)
        assert threading.active_count() - before <= metrics_http.MAX_HANDLERS
        for sock in silent:
            sock.close()
        deadline = time.monotonic() + metrics_http.TIMEOUT_S + 10
        while time.monotonic() < deadline:
            try:
                if _get(port)[0] == 200:
                    break
            except OSError:  # refused while the silent ones still hold every handler
                time.sleep(0.2)
        else:
            raise AssertionError("no scrape was answered after the silent connections closed")
    finally:
        endpoint.stop()
