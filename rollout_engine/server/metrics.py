"""Prometheus metrics of one server, in a registry of its own (nothing global, several servers per process).

Gauges are set from the engine process's stats, asked for at each scrape; counters and histograms are updated by
the request handlers as tokens go out. Tokens per second: rate(rollout_engine_generation_tokens_total[1m]).
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)
# gauge name -> (help, the value from EngineClient.stats())
GAUGES = {
    "rollout_engine_num_seqs_running": ("Sequences (samples) in the running batch, holding KV",
                                        lambda s: s["num_seqs_running"]),
    "rollout_engine_num_seqs_waiting": ("Sequences waiting for admission (or retracted, or held by a pause)",
                                        lambda s: s["num_seqs_waiting"]),
    "rollout_engine_kv_cache_usage": ("Fraction of KV blocks held by sequences (cached free blocks excluded)",
                                      lambda s: s["kv_blocks_used"] / s["kv_blocks_total"] if s["kv_blocks_total"]
                                      else 0.0),
    "rollout_engine_kv_blocks_used": ("KV blocks held by sequences", lambda s: s["kv_blocks_used"]),
    "rollout_engine_kv_blocks_cached": ("KV blocks the prefix cache can serve again (held by sequences or free)",
                                        lambda s: s["kv_blocks_cached"]),
    "rollout_engine_kv_blocks_total": ("KV blocks in the pool", lambda s: s["kv_blocks_total"]),
    "rollout_engine_weight_version": ("Version of the weights that serve", lambda s: s["weight_version"]),
    "rollout_engine_sleeping": ("1 while any part of the engine (weights or KV) is asleep",
                                lambda s: float(s["sleeping"])),
}


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = registry = CollectorRegistry(auto_describe=True)
        self.gauges = {name: (Gauge(name, doc, registry=registry), value) for name, (doc, value) in GAUGES.items()}
        self.requests_in_flight = Gauge("rollout_engine_http_requests_in_flight",
                                        "Generation requests the server is answering", registry=registry)
        self.requests = Counter("rollout_engine_http_requests", "Finished generation requests by endpoint and status",
                                ["endpoint", "status"], registry=registry)
        self.generation_tokens = Counter("rollout_engine_generation_tokens", "Tokens generated and sent to clients",
                                         registry=registry)
        self.prompt_tokens = Counter("rollout_engine_prompt_tokens", "Prompt tokens of admitted requests",
                                     registry=registry)
        self.finished = Counter("rollout_engine_finished_samples", "Samples finished, by finish reason",
                                ["finish_reason"], registry=registry)
        self.ttft = Histogram("rollout_engine_time_to_first_token_seconds", "Request arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.latency = Histogram("rollout_engine_request_latency_seconds", "Request arrival to its last token",
                                 buckets=LATENCY_BUCKETS, registry=registry)

    def render(self, stats: dict | None) -> bytes:
        """The metrics as Prometheus text; the gauges keep their last values when `stats` is None."""
        if stats is not None:
            for gauge, value in self.gauges.values():
                gauge.set(value(stats))
        return generate_latest(self.registry)
