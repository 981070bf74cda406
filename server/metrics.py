"""Prometheus metrics with vLLM's names and meanings, under a `paxserve:` prefix and again under
vLLM's `vllm:` (the same samples), so vLLM's dashboards and alerts read paxserve as they read vLLM.

Request-level histograms are measured here, in the server, as outputs arrive: TTFT = first token -
arrival, inter-token latency between successive token-bearing outputs, end-to-end latency at the
finish. Engine state (running/waiting/paused, KV-cache usage, prefix cache, preemptions, token
totals, failed steps) is the snapshot the step loop publishes after every step, so a scrape never
waits on the loop; its cumulative counts are exposed as counters. Each app owns its registry, so several apps in one process don't collide.
"""

from __future__ import annotations

import time
from typing import Any, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from paxserve.engine.stats import ITERATION_TOKEN_BUCKETS
from paxserve.outputs import RequestOutput

PREFIX = "paxserve:"
VLLM_PREFIX = "vllm:"
FINISH_REASONS = ("stop", "length", "abort", "error")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTION_BUCKETS = (0, 1, 2, 3, 4, 5, 10, 20)

# EngineSnapshot field -> (metric name, kind, help)
_ENGINE_METRICS = {
    "num_requests_running": ("num_requests_running", "gauge", "Number of requests in model execution batches."),
    "num_requests_waiting": ("num_requests_waiting", "gauge", "Number of requests waiting to be processed."),
    "num_requests_paused": ("num_requests_paused", "gauge",
                            "Number of requests held out of the batch because their reader is behind."),
    "kv_cache_usage": ("kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage."),
    "prefix_cache_queries": ("prefix_cache_queries", "counter",
                             "Prefix cache queries, in terms of number of queried tokens."),
    "prefix_cache_hits": ("prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens."),
    "num_preemptions": ("num_preemptions", "counter", "Cumulative number of preemptions from the engine."),
    "prompt_tokens": ("prompt_tokens", "counter", "Number of prefill tokens processed."),
    "generation_tokens": ("generation_tokens", "counter", "Number of generation tokens processed."),
    "num_failed_steps": ("engine_step_failures", "counter",
                         "Engine steps that raised; only the requests in them failed."),
    "num_kv_cache_resets": ("kv_cache_resets", "counter",
                            "Times a failed step lost the KV cache and it was made anew."),
    "spec_decode_num_drafts": ("spec_decode_num_drafts", "counter", "Number of spec decoding drafts."),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens", "counter", "Number of draft tokens."),
    "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens", "counter",
                                        "Number of accepted tokens."),
}


def _1_2_5_buckets(limit: int) -> list[float]:
    out, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > limit:
                return out
            out.append(float(value))
        exponent += 1


class _EngineCollector(Collector):
    """Yields the last engine snapshot at scrape time (refreshed by the /metrics handler)."""

    def __init__(self, model_name: str, info: dict[str, str]) -> None:
        self.model_name = model_name
        self.info = info
        self.snapshot: dict[str, float] = {}

    def collect(self) -> Iterable[Metric]:
        for key, (name, kind, doc) in _ENGINE_METRICS.items():
            if key not in self.snapshot:
                continue
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self.model_name], float(self.snapshot[key]))
            yield family
        per_position = self.snapshot.get("spec_decode_accepted_per_position")
        if per_position:
            family = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                         "Accepted tokens per draft position.", labels=["model_name", "position"])
            for position, count in enumerate(per_position):
                family.add_metric([self.model_name, str(position)], float(count))
            yield family
        if self.snapshot.get("max_lora"):
            # vLLM's: one series whose labels name the adapters running and waiting requests use
            # (comma-separated), valued the time of the snapshot.
            family = GaugeMetricFamily(PREFIX + "lora_requests_info", "Running stats on LoRA requests.",
                                       labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
            family.add_metric([str(self.snapshot["max_lora"]), ",".join(self.snapshot.get("lora_waiting", ())),
                               ",".join(self.snapshot.get("lora_running", ()))], time.time())
            yield family
        if "num_requests_waiting" in self.snapshot:
            # vLLM's reasons: "capacity" waits for a batch place or KV blocks; "deferred" is held out
            # by something else (here: a reader behind its stream, paused).
            family = GaugeMetricFamily(PREFIX + "num_requests_waiting_by_reason", "Number of requests waiting, by "
                                       "why they wait.", labels=["model_name", "reason"])
            family.add_metric([self.model_name, "capacity"], float(self.snapshot["num_requests_waiting"]))
            family.add_metric([self.model_name, "deferred"], float(self.snapshot.get("num_requests_paused", 0)))
            yield family
        buckets = self.snapshot.get("iteration_tokens_buckets")
        if buckets:
            family = HistogramMetricFamily(PREFIX + "iteration_tokens_total",
                                           "Histogram of number of tokens per engine_step.", labels=["model_name"])
            bounds = [str(float(b)) for b in ITERATION_TOKEN_BUCKETS] + ["+Inf"]
            family.add_metric([self.model_name], list(zip(bounds, map(float, buckets))),
                              float(self.snapshot.get("iteration_tokens_sum", 0)))
            yield family
        if self.info:
            info = GaugeMetricFamily(PREFIX + "cache_config_info", "Information of the KV-cache config.",
                                     labels=sorted(self.info))
            info.add_metric([self.info[k] for k in sorted(self.info)], 1.0)
            yield info


class ServerMetrics:
    def __init__(self, model_name: str, max_model_len: int, engine_info: dict[str, str] | None = None) -> None:
        self.registry = registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        self.engine = _EngineCollector(model_name, engine_info or {})
        registry.register(self.engine)
        ProcessCollector(registry=registry)
        self.request_success = Counter(PREFIX + "request_success", "Count of successfully processed requests.",
                                       ["model_name", "finished_reason"], registry=registry)
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name, reason)

        def histogram(name: str, doc: str, buckets: Iterable[float]) -> Any:
            return Histogram(PREFIX + name, doc, labels, buckets=tuple(buckets), registry=registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                             E2E_BUCKETS)
        token_buckets = _1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Number of prefill tokens processed.",
                                               token_buckets)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Number of generation tokens processed.", token_buckets)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Histogram of time spent waiting before first scheduled, in seconds.", E2E_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds",
                                      "Histogram of time from first scheduled to the first token, in seconds.",
                                      E2E_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds",
                                     "Histogram of time from the first token to the last, in seconds.", E2E_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds",
                                        "Histogram of time from first scheduled to the last token, in seconds.",
                                        E2E_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "Histogram of a request's decode time per output token after the first, in seconds.",
                              ITL_BUCKETS)
        self.params_n = histogram("request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.params_max_tokens = histogram("request_params_max_tokens",
                                           "Histogram of the max_tokens request parameter.", token_buckets)
        self.max_generation_tokens = histogram("request_max_num_generation_tokens",
                                               "Histogram of the most generation tokens of a request's samples.",
                                               token_buckets)
        self.prefill_kv_computed = histogram("request_prefill_kv_computed_tokens",
                                             "Histogram of prompt tokens computed per request (not from the "
                                             "prefix cache).", token_buckets)
        self.num_preemptions = histogram("request_num_preemptions", "Histogram of preemptions per finished "
                                         "request.", PREEMPTION_BUCKETS)

    def update_engine(self, snapshot: dict[str, Any]) -> None:
        self.engine.snapshot = dict(snapshot)

    def render(self) -> bytes:
        """The exposition, every `paxserve:` family followed by the same under `vllm:`."""
        text = generate_latest(self.registry)
        ours = [line for line in text.split(b"\n") if line.startswith((PREFIX.encode(), b"# HELP " + PREFIX.encode(),
                                                                        b"# TYPE " + PREFIX.encode()))]
        theirs = b"\n".join(line.replace(PREFIX.encode(), VLLM_PREFIX.encode(), 1) for line in ours)
        return text + theirs + b"\n"

    def tracker(self, arrival: float, n: int = 1, max_tokens: int | None = None) -> "RequestTracker":
        return RequestTracker(self, arrival, n, max_tokens)


class RequestTracker:
    """Latency and outcome of one engine request (one prompt and its n samples), from its delta
    outputs as they arrive."""

    def __init__(self, metrics: ServerMetrics, arrival: float, n: int = 1, max_tokens: int | None = None) -> None:
        self.metrics = metrics
        self.arrival = arrival
        self.n = n
        self.max_tokens = max_tokens
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.finished = False
        self.num_tokens: dict[int, int] = {}  # sample index -> tokens so far
        self.finish_reasons: dict[int, str] = {}

    def on_output(self, out: RequestOutput, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        new_tokens = False
        for o in out.outputs:
            self.num_tokens[o.index] = self.num_tokens.get(o.index, 0) + len(o.token_ids)
            new_tokens = new_tokens or bool(o.token_ids)
            if o.finish_reason is not None:
                self.finish_reasons[o.index] = o.finish_reason
        if new_tokens:
            if self.first_token_at is None:
                self.first_token_at = now
                self.metrics.ttft.observe(now - self.arrival)
            else:
                self.metrics.itl.observe(now - self.last_token_at)
            self.last_token_at = now
        if out.finished and not self.finished:
            self.finished = True
            self.metrics.e2e.observe(now - self.arrival)
            self.metrics.request_prompt_tokens.observe(len(out.prompt_token_ids))
            for index, count in self.num_tokens.items():
                self.metrics.request_generation_tokens.observe(count)
                reason = self.finish_reasons.get(index, "abort")
                self.metrics.request_success.labels(self.metrics.model_name, reason).inc()
            self._observe_finished(out)

    def _observe_finished(self, out: RequestOutput) -> None:
        """vLLM's per-request histograms of a finished request: its parameters, what its prompt cost,
        and its time in the queue, in prefill and in decode (from when it was first scheduled)."""
        m = self.metrics
        m.params_n.observe(self.n)
        if self.max_tokens is not None:
            m.params_max_tokens.observe(self.max_tokens)
        most = max(self.num_tokens.values(), default=0)
        m.max_generation_tokens.observe(most)
        m.prefill_kv_computed.observe(max(0, len(out.prompt_token_ids) - out.num_cached_tokens))
        m.num_preemptions.observe(out.num_preemptions)
        scheduled = out.first_scheduled_time
        if scheduled is None or self.first_token_at is None:
            return  # it never ran, or ended before a token
        m.queue_time.observe(max(0.0, scheduled - self.arrival))
        m.prefill_time.observe(max(0.0, self.first_token_at - scheduled))
        decode = self.last_token_at - self.first_token_at
        m.decode_time.observe(decode)
        m.inference_time.observe(max(0.0, self.last_token_at - scheduled))
        if most > 1:
            m.tpot.observe(decode / (most - 1))

    def on_abort(self, num_seqs: int) -> None:
        """The request ended early (disconnect, shutdown): count its samples as aborted."""
        if not self.finished:
            self.finished = True
            self.metrics.request_success.labels(self.metrics.model_name, "abort").inc(num_seqs)
