"""Prometheus metrics of one app instance (its own registry, so several apps never clash).

Counters and histograms are updated as requests run; the gauges describing the scheduler
(running and waiting requests, KV usage) are refreshed from `get_internal_state` at scrape time.
The counters of early ends (aborts by cause, timeouts, rejections, outputs for unknown rids) are
read at scrape time too (`watch_counters`): the TokenizerManager's (generation requests) and
every EmbeddingManager's (pooled requests), summed per label value: pooled and generation
requests share the series (same names and labels; every abort cause, "shutdown" included, is
exported from the start, at 0).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "sluice_http_requests",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "sluice_time_to_first_token_seconds", "time to first token (streamed requests)",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "sluice_inter_token_latency_seconds", "time between output tokens (streamed requests)",
            buckets=_ITL_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "sluice_e2e_request_latency_seconds", "request latency, receipt to last token",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter("sluice_prompt_tokens", "prompt tokens", registry=r)
        self.cached_tokens = Counter(
            "sluice_cached_prompt_tokens", "prompt tokens from cache", registry=r
        )
        self.generation_tokens = Counter("sluice_generation_tokens", "generated tokens", registry=r)
        self.num_running = Gauge("sluice_num_running_reqs", "requests running", registry=r)
        self.num_waiting = Gauge("sluice_num_waiting_reqs", "requests waiting", registry=r)
        self.kv_usage = Gauge(
            "sluice_kv_usage_ratio", "KV slots held by live requests / total", registry=r
        )
        self.kv_cached = Gauge(
            "sluice_kv_cached_tokens", "KV slots held by the radix cache", registry=r
        )
        self.kv_total = Gauge("sluice_kv_total_tokens", "KV pool size in tokens", registry=r)
        self.cache_hit_rate = Gauge(
            "sluice_cache_hit_rate", "cached prompt tokens / prompt tokens, since start", registry=r
        )
        self.num_prompt_tokens = 0  # running sums behind cache_hit_rate
        self.num_cached_tokens = 0

    def watch_counters(self, *sources: Callable[[], dict[str, Any]]) -> None:
        """Export the sum of `source()` (RequestCounters.as_dict) over `sources` at every
        scrape. Call once: the families may be registered once only."""
        self.registry.register(_CountersCollector(list(sources)))

    def track(self) -> RequestTracker:
        return RequestTracker(self)

    def additive_samples(self) -> list[tuple[str, dict[str, str], float]]:
        """(sample name, labels, value) of every counter and histogram sample (not `_created`):
        what another HTTP worker adds to its own in `render`."""
        return [
            (sample.name, dict(sample.labels), float(sample.value))
            for family in self.registry.collect()
            if family.type in _ADDITIVE
            for sample in family.samples
            if not sample.name.endswith("_created")
        ]

    def render(self, state: dict[str, Any] | None, peers: list[Any] | None = None) -> bytes:
        """The page; with `peers` (PeerMetricsReply of the other HTTP workers), every counter
        and histogram is the sum over all workers, and the cache hit rate theirs together."""
        peers = peers or []
        if state is not None:
            total = max(int(state.get("kv_total", 0)), 1)
            self.num_running.set(state.get("num_running_reqs", 0))
            self.num_waiting.set(state.get("num_waiting_reqs", 0))
            self.kv_usage.set(state.get("kv_in_use", 0) / total)
            self.kv_cached.set(state.get("kv_cached", 0))
            self.kv_total.set(state.get("kv_total", 0))
        prompt = self.num_prompt_tokens + sum(p.num_prompt_tokens for p in peers)
        cached = self.num_cached_tokens + sum(p.num_cached_tokens for p in peers)
        self.cache_hit_rate.set(cached / prompt if prompt else 0.0)
        if not peers:
            return generate_latest(self.registry)
        return generate_latest(_Summed(self.registry, [s for p in peers for s in p.samples]))


_ADDITIVE = ("counter", "histogram")
_SUFFIXES = ("_total", "_bucket", "_count", "_sum", "")


class _Summed(Collector):
    """`registry` with the other workers' `samples` (MetricSample) added to its counters and
    histograms; a label set only another worker has is added to its family."""

    def __init__(self, registry: CollectorRegistry, samples: list[Any]) -> None:
        self.registry = registry
        self.extra: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for s in samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            self.extra[key] = self.extra.get(key, 0.0) + s.value

    def collect(self) -> Iterator[Any]:
        for family in self.registry.collect():
            if family.type in _ADDITIVE:
                family.samples = self._summed(family)
            yield family

    def _summed(self, family: Any) -> list[Any]:
        names = {family.name + suffix for suffix in _SUFFIXES}
        samples, seen = [], set()
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            seen.add(key)
            samples.append(sample._replace(value=sample.value + self.extra.get(key, 0.0)))
        for (name, labels), value in self.extra.items():
            if name in names and (name, labels) not in seen:
                samples.append(Sample(name, dict(labels), value))
        return samples


class _CountersCollector(Collector):
    _LABELLED = (
        ("aborts", "sluice_request_aborts", "requests ended early, by cause", "cause"),
        ("timeouts", "sluice_request_timeouts", "requests ended by a timeout, by kind", "kind"),
        ("rejected", "sluice_rejected_requests", "requests refused (429/503)", "reason"),
    )

    def __init__(self, sources: list[Callable[[], dict[str, Any]]]) -> None:
        self.sources = sources

    def collect(self) -> Iterator[CounterMetricFamily]:
        counts = sum_counts([source() for source in self.sources])
        for key, name, doc, label in self._LABELLED:
            family = CounterMetricFamily(name, doc, labels=[label])
            for value, num in counts[key].items():
                family.add_metric([value], num)
            yield family
        yield CounterMetricFamily(
            "sluice_unknown_rid_outputs", "outputs that arrived for an rid nobody holds (zombies)",
            value=counts["unknown_rid_outputs"],
        )  # fmt: skip


def sum_counts(counts: list[dict[str, Any]]) -> dict[str, Any]:
    """RequestCounters.as_dict of several owners added up, per label value."""
    total: dict[str, Any] = {key: {} for key, _, _, _ in _CountersCollector._LABELLED}
    for one in counts:
        for key, by_value in total.items():
            for value, num in one[key].items():
                by_value[value] = by_value.get(value, 0) + num
    total["unknown_rid_outputs"] = sum(one["unknown_rid_outputs"] for one in counts)
    return total


class RequestTracker:
    """Latency of one request: TTFT and inter-token gaps per choice index, then e2e."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.start = time.perf_counter()
        # index -> (time of the last update with new tokens, completion tokens then)
        self._last: dict[int, tuple[float, int]] = {}

    def on_output(self, item: dict[str, Any]) -> None:
        num = int(item["meta_info"].get("completion_tokens") or 0)
        now = time.perf_counter()
        prev = self._last.get(item["index"])
        if prev is None:
            if num > 0:
                self.metrics.ttft.observe(now - self.start)
                self._last[item["index"]] = (now, num)
        elif num > prev[1]:
            self.metrics.itl.observe((now - prev[0]) / (num - prev[1]))
            self._last[item["index"]] = (now, num)

    def on_finish(self, usage: dict[str, Any]) -> None:
        m = self.metrics
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        m.e2e.observe(time.perf_counter() - self.start)
        m.prompt_tokens.inc(usage["prompt_tokens"])
        m.generation_tokens.inc(usage["completion_tokens"])
        m.cached_tokens.inc(cached)
        m.num_prompt_tokens += usage["prompt_tokens"]
        m.num_cached_tokens += cached


class RequestCountMiddleware:
    """Counts every HTTP request by route (known paths, else "other") and status."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, routes: set[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope["path"] if scope["path"] in self.routes else "other"
            self.metrics.requests.labels(route=route, status=str(status)).inc()
