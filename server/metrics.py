"""Prometheus metrics under vLLM's `vllm:` names (prometheus_client, text format 0.0.4).

Engine-side numbers (requests running/waiting, KV-cache usage, token and prefix-cache counters,
preemptions) are read from `LLMEngine.metrics_snapshot()` at scrape time; per-request latencies
(TTFT, inter-token, end-to-end) are observed by the server as tokens reach the HTTP stream, which is
what a client experiences.
"""
from __future__ import annotations

import logging
import os
from typing import Callable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the app)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger("jitkern.server")

# No `*_created` series next to every counter and histogram (vLLM turns them off the same way).
prometheus_client.disable_created_metrics()

# Bucket edges as vLLM's (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


def _token_buckets(max_model_len: int) -> tuple:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's build_1_2_5_buckets)."""
    out, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10 ** exponent
            if value > max_model_len:
                return tuple(out)
            out.append(float(value))
        exponent += 1


class _EngineCollector:
    """Reads the engine's counters at scrape time."""

    def __init__(self, snapshot: Callable[[], dict], model_name: str):
        self.snapshot = snapshot
        self.model_name = model_name

    def describe(self):
        return []   # collect() talks to the engine: do not let register() call it

    def collect(self):
        try:
            snap = self.snapshot()
        except Exception as e:  # noqa: BLE001 - a scrape must not fail because the engine is busy or gone
            log.warning("metrics: could not read the engine's counters: %s", e)
            return
        labels = ["model_name"]
        values = [self.model_name]
        # data parallelism (engine.data_parallel): each replica's number under engine="<rank>" (vLLM's label),
        # next to the sum over replicas, which keeps the model_name label alone
        replicas = snap.get("replicas") or {}

        def per_replica(family, name):
            key = {"vllm:kv_cache_usage_perc": "kv_cache_usage"}.get(name, name.partition(":")[2])
            for rank, rs in sorted(replicas.items()):
                family.add_metric(values + [str(rank)], float(rs.get(key, 0)))
            return family

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=labels + (["engine"] if replicas else []))
            g.add_metric(values, float(value))
            return per_replica(g, name) if replicas else g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=labels + (["engine"] if replicas else []))
            c.add_metric(values, float(value))
            return per_replica(c, name) if replicas else c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    snap.get("num_requests_running", 0))
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    snap.get("num_requests_waiting", 0))
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    snap.get("kv_cache_usage", 0.0))
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", snap.get("prompt_tokens", 0))
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.",
                      snap.get("generation_tokens", 0))
        yield counter("vllm:prefix_cache_queries", "Prefix-cache queries, in terms of number of queried tokens.",
                      snap.get("prefix_cache_queries", 0))
        yield counter("vllm:prefix_cache_hits", "Prefix-cache hits, in terms of number of cached tokens.",
                      snap.get("prefix_cache_hits", 0))
        yield counter("vllm:num_preemptions", "Cumulative number of preemptions from the engine.",
                      snap.get("num_preemptions", 0))
        if replicas:
            yield gauge("jitkern:dp_replica_up", "1 while a data-parallel replica serves (sum: replicas up).",
                        snap.get("dp_replica_up", 0))
            yield counter("jitkern:dp_replica_restarts", "Restarts of a data-parallel replica after it died.",
                          snap.get("dp_replica_restarts", 0))
            yield counter("jitkern:dp_routed_requests", "Requests routed to a data-parallel replica.",
                          snap.get("dp_routed_requests", 0))
            yield counter("jitkern:dp_routed_by_prefix_requests",
                          "Requests routed to a replica because it holds their prompt's longest cached prefix.",
                          snap.get("dp_routed_by_prefix_requests", 0))
        if "spec_decode_num_drafts" in snap:        # speculative decoding on (engine.spec_decode)
            yield counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.",
                          snap["spec_decode_num_drafts"])
            yield counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                          snap["spec_decode_num_draft_tokens"])
            yield counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                          snap["spec_decode_num_accepted_tokens"])
            c = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                    "Accepted tokens per draft position.", labels=labels + ["position"])
            for pos, n in enumerate(snap.get("spec_decode_num_accepted_tokens_per_pos", ())):
                c.add_metric(values + [str(pos)], float(n))
            yield c


class ServerMetrics:
    def __init__(self, model_name: str, snapshot: Callable[[], dict], max_model_len: int):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        self._engine_collector = _EngineCollector(snapshot, model_name)
        self.registry.register(self._engine_collector)
        labels = ["model_name"]
        reg = self.registry
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=TTFT_BUCKETS, registry=reg).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             labels, buckets=ITL_BUCKETS, registry=reg).labels(model_name)
        self.tpot = Histogram("vllm:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds (per request, after the first).",
                              labels, buckets=ITL_BUCKETS, registry=reg).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of end-to-end request latency in seconds.",
                             labels, buckets=E2E_BUCKETS, registry=reg).labels(model_name)
        token_buckets = _token_buckets(max(max_model_len, 1))
        self.prompt_tokens = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens per request.",
                                       labels, buckets=token_buckets, registry=reg).labels(model_name)
        self.generation_tokens = Histogram("vllm:request_generation_tokens",
                                           "Number of generation tokens per request.", labels,
                                           buckets=token_buckets, registry=reg).labels(model_name)
        self._success = Counter("vllm:request_success", "Count of finished requests, by finish reason.",
                                labels + ["finished_reason"], registry=reg)

    def request_finished(self, finished_reason: str, *, arrival: float, first_token: float | None, finished: float,
                         num_prompt_tokens: int, num_generation_tokens: int) -> None:
        self._success.labels(self.model_name, finished_reason or "abort").inc()
        self.e2e.observe(max(finished - arrival, 0.0))
        self.prompt_tokens.observe(num_prompt_tokens)
        self.generation_tokens.observe(num_generation_tokens)
        if first_token is not None and num_generation_tokens > 1:
            self.tpot.observe(max(finished - first_token, 0.0) / (num_generation_tokens - 1))

    def render(self) -> bytes:
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            # several API processes (server/shared_engine.py): their histograms and counters added up from the
            # multiprocess files, the engine's numbers read once from the engine
            from prometheus_client import multiprocess
            reg = CollectorRegistry(auto_describe=False)
            multiprocess.MultiProcessCollector(reg)
            reg.register(self._engine_collector)
            return generate_latest(reg)
        return generate_latest(self.registry)
