"""The server's metrics in Prometheus' text format (prometheus-client), named as vLLM names its own
(`tinyvlm:` instead of `vllm:`) so that dashboards carry over: the engine's state read at each scrape
(requests running and waiting, KV-cache blocks and usage, prefix-cache lookups and hits, preemptions, prompt
and generated tokens) and each request's latencies (time to first token, time between tokens, end to end) and
how it ended."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                   40.0, 80.0)


class EngineCollector:
    """The engine's `stats()` as gauges and counters, read when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], dict], model_name: str) -> None:
        self.stats, self.labels = stats, {"model_name": model_name}

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        gauges = {
            "num_requests_running": ("running", "Requests whose sequences hold KV blocks."),
            "num_requests_waiting": ("waiting", "Requests waiting to be admitted (preempted ones included)."),
            "kv_cache_blocks_used": ("kv_blocks_used", "KV-cache blocks in use."),
            "kv_cache_blocks_total": ("kv_blocks_total", "KV-cache blocks in all."),
            "prefix_cache_hit_rate": (
                "prefix_hit_rate",
                "Share of looked-up full prompt blocks found cached.",
            ),
        }
        counters = {
            "num_preemptions": (
                "preemptions",
                "Requests preempted (their KV blocks freed, recomputed later).",
            ),
            "prompt_tokens": ("prompt_tokens", "Prompt tokens of the requests accepted."),
            "generation_tokens": ("generation_tokens", "Tokens generated."),
            "prefix_cache_queries": (
                "prefix_cache_lookups",
                "Full prompt blocks looked up in the prefix cache.",
            ),
            "prefix_cache_hits": ("prefix_cache_hits", "Full prompt blocks found in the prefix cache."),
        }
        for name, (key, help_text) in gauges.items():
            family = GaugeMetricFamily(f"tinyvlm:{name}", help_text, labels=list(self.labels))
            family.add_metric(list(self.labels.values()), stats[key])
            yield family
        usage = GaugeMetricFamily("tinyvlm:kv_cache_usage_perc", "KV-cache usage, 1 = full.",
                                  labels=list(self.labels))
        usage.add_metric(list(self.labels.values()),
                         stats["kv_blocks_used"] / max(stats["kv_blocks_total"], 1))
        yield usage
        for name, (key, help_text) in counters.items():
            family = CounterMetricFamily(f"tinyvlm:{name}", help_text, labels=list(self.labels))
            family.add_metric(list(self.labels.values()), stats[key])
            yield family


class ServerMetrics:
    """A registry of the app's own (several apps in one process do not clash) with the engine's state and the
    request latencies the server observes."""

    def __init__(self, stats: Callable[[], dict], model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(stats, model_name))
        labels = {"labelnames": ["model_name"], "registry": self.registry}
        self.time_to_first_token = Histogram("tinyvlm:time_to_first_token_seconds",
                                             "Seconds from a request's arrival to its first token.",
                                             buckets=LATENCY_BUCKETS, **labels).labels(model_name)
        self.inter_token_latency = Histogram("tinyvlm:inter_token_latency_seconds",
                                             "Seconds between a request's "
                                             "tokens.", buckets=LATENCY_BUCKETS, **labels).labels(model_name)
        self.e2e_request_latency = Histogram("tinyvlm:e2e_request_latency_seconds",
                                             "Seconds from a request's arrival to its end.",
                                             buckets=LATENCY_BUCKETS, **labels).labels(model_name)
        self.request_success = Counter("tinyvlm:request_success", "Requests finished, by why they ended.",
                                       ["model_name", "finished_reason"], registry=self.registry)
        self.model_name = model_name

    def render(self) -> bytes:
        return generate_latest(self.registry)
