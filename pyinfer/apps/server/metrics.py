"""`GET /metrics` in Prometheus' text format: requests, tokens in and out, speed, queue and prompt-cache use.
Counters are totals since start (take rate() of them); a registry of its own per server."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pyinfer.apps.server.engine import Engine
from pyinfer.engine.completions import Usage

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self, engine: Engine, model: str, n_ctx: int) -> None:
        r = self.registry = CollectorRegistry()
        self._prompt_total = self._cached_total = 0  # for the hit ratio (counters do not expose their values)
        self.requests = Counter("pyinfer_requests", "HTTP requests answered, by path and status",
                                ["path", "status"], registry=r)
        self.prompt_tokens = Counter("pyinfer_prompt_tokens", "prompt tokens of completions", registry=r)
        self.cached_tokens = Counter("pyinfer_prompt_cached_tokens",
                                     "prompt tokens reused from the KV cache instead of processed", registry=r)
        self.cache_hits = Counter("pyinfer_prompt_cache_hits", "completions that reused part of the KV cache",
                                  registry=r)
        self.completion_tokens = Counter("pyinfer_completion_tokens", "tokens generated", registry=r)
        self.prompt_seconds = Counter("pyinfer_prompt_seconds", "time spent processing prompts", registry=r)
        self.generation_seconds = Counter("pyinfer_generation_seconds", "time spent generating after the first "
                                          "token", registry=r)
        self.cancelled = Counter("pyinfer_completions_cancelled", "completions stopped because the client went "
                                 "away", registry=r)
        self.time_to_first_token = Histogram("pyinfer_time_to_first_token_seconds", "from the request's arrival "
                                             "(queue included) to its first token", buckets=LATENCY_BUCKETS,
                                             registry=r)
        self.duration = Histogram("pyinfer_completion_duration_seconds", "from the request's arrival (queue "
                                  "included) to its last token", buckets=LATENCY_BUCKETS, registry=r)
        self.tokens_per_second = Gauge("pyinfer_tokens_per_second", "decoding speed of the last completion",
                                       registry=r)
        Gauge("pyinfer_queue_length", "requests waiting for the engine", registry=r).set_function(
            lambda: engine.waiting)
        Gauge("pyinfer_requests_processing", "requests the engine is running (0 or 1)", registry=r).set_function(
            lambda: int(engine.busy))
        Gauge("pyinfer_prompt_cache_hit_ratio", "share of prompt tokens reused from the KV cache",
              registry=r).set_function(self._hit_ratio)
        Gauge("pyinfer_model_info", "the loaded model", ["model", "n_ctx"], registry=r).labels(model, str(n_ctx)).set(1)

    def record(self, usage: Usage, waited_s: float, cancelled: bool) -> None:
        """One completion that ran (finished, stopped, or cancelled by its client)."""
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.cached_tokens.inc(usage.cached_tokens)
        self._prompt_total += usage.prompt_tokens
        self._cached_total += usage.cached_tokens
        self.cache_hits.inc(usage.cached_tokens > 0)
        self.completion_tokens.inc(usage.completion_tokens)
        self.prompt_seconds.inc(usage.prompt_ms / 1e3)
        self.generation_seconds.inc(usage.generation_ms / 1e3)
        if cancelled:
            self.cancelled.inc()
            return
        self.time_to_first_token.observe(waited_s + usage.prompt_ms / 1e3)
        self.duration.observe(waited_s + (usage.prompt_ms + usage.generation_ms) / 1e3)
        if usage.completion_tokens > 1:
            self.tokens_per_second.set(usage.tokens_per_second)

    def _hit_ratio(self) -> float:
        return self._cached_total / self._prompt_total if self._prompt_total else 0.0

    def text(self) -> bytes:
        return generate_latest(self.registry)
