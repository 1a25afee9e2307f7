"""/metrics across HTTP workers (sluice/server/metrics.py): a worker's page with the other
workers' samples added is the sum of every worker's counters and histograms."""

from __future__ import annotations

from sluice.messages import MetricSample, PeerMetricsReply
from sluice.server.metrics import ServerMetrics
from tests.server.live_server import metric


def _reply(m: ServerMetrics) -> PeerMetricsReply:
    samples = [MetricSample(*s) for s in m.additive_samples()]
    return PeerMetricsReply(1, 1, samples, m.num_prompt_tokens, m.num_cached_tokens)


def test_counters_and_histograms_sum_over_workers() -> None:
    a, b = ServerMetrics(), ServerMetrics()
    a.requests.labels(route="/generate", status="200").inc(2)
    b.requests.labels(route="/generate", status="200").inc(3)
    b.requests.labels(route="/v1/embeddings", status="400").inc()  # only b has this label set
    for m, tokens in ((a, 5), (b, 7)):
        m.generation_tokens.inc(tokens)
        m.e2e.observe(0.02)
    a.num_prompt_tokens, a.num_cached_tokens = 10, 0
    b.num_prompt_tokens, b.num_cached_tokens = 30, 20
    page = a.render(None, [_reply(b)]).decode()
    assert metric(page, 'sluice_http_requests_total{route="/generate",status="200"}') == 5
    assert metric(page, 'sluice_http_requests_total{route="/v1/embeddings",status="400"}') == 1
    assert metric(page, "sluice_generation_tokens_total") == 12
    assert metric(page, "sluice_e2e_request_latency_seconds_count") == 2
    assert metric(page, 'sluice_e2e_request_latency_seconds_bucket{le="0.025"}') == 2
    assert metric(page, "sluice_cache_hit_rate") == 0.5
    alone = a.render(None).decode()  # one worker: its own figures
    assert metric(alone, "sluice_generation_tokens_total") == 5
