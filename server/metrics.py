"""Prometheus metrics at `/metrics`, named as SGLang names them (`sglang:*`, label `model_name`).

Two sources, one registry per app (never prometheus_client's global one, so several apps in one
process do not collide):

    TokenizerManager ──observe(out, acc) on every detokenized update──► counters, histograms
    GET /metrics ──tm.control("server_info")──► scheduler gauges (refreshed on each scrape)

Per-request counters are added when a request finishes, from the numbers its client sees; a
request whose client went away before the end is not counted.
"""

from __future__ import annotations

import time
import weakref

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from sgl_tpu.messages import ReqStrOut
from sgl_tpu.response import ResponseAccumulator
from sgl_tpu.server.tokenizer_manager import TokenizerManager

PREFIX = "sglang:"
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0,
                  80.0, 160.0)
ITL_BUCKETS_S = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                 1.0, 2.0, 5.0)
# (/server_info "tiers" key, metric name after "sglang:hicache_", help)
TIER_GAUGES = (
    ("hit_tokens", "hit_tokens", "Prompt tokens loaded from this tier into the KV pool"),
    ("load_bytes", "load_bytes", "Bytes loaded from this tier into the KV pool"),
    ("load_s", "load_seconds", "Seconds spent loading from this tier"),
    ("demote_bytes", "demote_bytes", "Bytes written into this tier"),
    ("demote_s", "demote_seconds", "Seconds spent writing into this tier"),
    ("used_pages", "used_pages", "KV pages this tier holds"),
    ("skipped_tokens", "skipped_tokens",
     "Prompt tokens this tier held that were computed: below its load crossover"),
)
# (/server_info "programs" key, metric name after "sglang:", help)
PROGRAM_GAUGES = (
    ("num_programs", "num_programs", "Programs (agents) the scheduler remembers"),
    ("num_active", "num_programs_active", "Programs with a request in the server"),
    ("num_paused", "num_programs_paused", "Programs paused on a tool (no request in flight)"),
    ("num_held", "num_programs_held", "Programs whose first turn admission control holds"),
    ("num_programs_held", "programs_held_total", "Programs admission control ever held"),
    ("program_held_s", "program_held_seconds_total", "Seconds programs were held, summed"),
    ("resident_working_set_tokens", "program_working_set_tokens",
     "KV working sets of the admitted active and paused programs, in tokens"),
)
# (/server_info "programs" "kv" key, metric name after "sglang:program_", help); labelled
# program="all" (every program, since start-up) and by the public id of each recent program
PROGRAM_KV_GAUGES = (
    ("reused_tokens", "reused_tokens", "Cached prompt tokens that were in the KV pool on arrival"),
    ("loaded_tokens", "loaded_tokens", "Cached prompt tokens loaded from a KV cache tier"),
    ("computed_tokens", "computed_tokens", "Prompt tokens prefilled"),
    ("prefetched_tokens", "prefetched_tokens",
     "Tokens moved from a KV cache tier into the pool ahead of a paused program's next request"),
    ("num_prefetches", "prefetches", "Prefetches started"),
    ("num_prefetch_hits", "prefetch_hits", "Prefetches done before the program came back"),
    ("num_prefetch_late", "prefetch_late", "Prefetches still moving when the program came back"),
    ("num_prefetch_wasted", "prefetch_wasted",
     "Prefetches evicted again, or whose program did not come back within its pause window"),
    ("num_prefetch_skipped", "prefetch_skipped",
     "Pauses whose prefetch was not started: the programs expected back sooner and the waiting "
     "requests would claim the room first"),
)
E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.num_running_reqs = gauge("num_running_reqs", "Requests in the decode batch")
        self.num_waiting_reqs = gauge("num_waiting_reqs", "Requests waiting to be scheduled")
        self.token_usage = gauge("token_usage",
                                 "Fraction of KV cache pages held by requests and the radix tree")
        self.cache_hit_rate = gauge("cache_hit_rate",
                                    "Prompt tokens served from the radix cache / prompt tokens")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens",
                                         "Generated tokens of finished requests")
        self.cached_tokens = counter("cached_tokens",
                                     "Prompt tokens of finished requests found in the cache")
        self.num_requests = counter("num_requests", "Finished requests")
        self.time_to_first_token = histogram("time_to_first_token_seconds",
                                             "Time from arrival to the first output token",
                                             TTFT_BUCKETS_S)
        self.inter_token_latency = histogram("inter_token_latency_seconds",
                                             "Time between consecutive output tokens",
                                             ITL_BUCKETS_S)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds",
                                             "Time from arrival to the last output token",
                                             E2E_BUCKETS_S)
        # KV cache tiers (`/server_info` "tiers"), per tier; totals since start-up, set from
        # the scheduler's snapshot on each scrape
        self._model_name = model_name
        # programs (`/server_info` "programs", scheduler/programs.py)
        self.program_gauges = {
            key: gauge(name, doc) for key, name, doc in PROGRAM_GAUGES}
        self.program_kv_gauges = {
            key: Gauge(PREFIX + "program_" + name, doc, ["model_name", "program"],
                       registry=self.registry)
            for key, name, doc in PROGRAM_KV_GAUGES}
        self.tier_gauges = {
            key: Gauge(PREFIX + "hicache_" + name, doc, ["model_name", "tier"],
                       registry=self.registry)
            for key, name, doc in TIER_GAUGES}
        # request -> (time of the last update that brought tokens, completion tokens by then);
        # weak, so requests that end without a final update (client gone) leave nothing behind
        self._last_token: weakref.WeakKeyDictionary[ResponseAccumulator, tuple[float, int]] = (
            weakref.WeakKeyDictionary())

    def observe(self, out: ReqStrOut, acc: ResponseAccumulator) -> None:
        """Called by the TokenizerManager after `acc.update(out)`; must stay cheap."""
        now = time.perf_counter()
        last = self._last_token.get(acc)
        if last is None and acc.first_token_time is not None:
            self.time_to_first_token.observe(acc.first_token_time - acc.start_time)
            self._last_token[acc] = (acc.first_token_time, out.completion_tokens)
        elif last is not None and out.completion_tokens > last[1]:
            num_new = out.completion_tokens - last[1]
            per_token_s = (now - last[0]) / num_new
            for _ in range(num_new):
                self.inter_token_latency.observe(per_token_s)
            self._last_token[acc] = (now, out.completion_tokens)
        if out.finished:
            self._last_token.pop(acc, None)
            self.e2e_request_latency.observe(now - acc.start_time)
            self.prompt_tokens.inc(out.prompt_tokens)
            self.generation_tokens.inc(out.completion_tokens)
            self.cached_tokens.inc(out.cached_tokens)
            self.num_requests.inc()

    def set_scheduler_state(self, info: dict) -> None:
        """Gauges from the scheduler's `server_info` answer."""
        self.num_running_reqs.set(info["num_running_reqs"])
        self.num_waiting_reqs.set(info["num_waiting_reqs"])
        mem = info["memory"]
        total = mem["num_pages_total"]
        self.token_usage.set((total - mem["num_pages_free"]) / total if total else 0.0)
        stats = info["stats"]
        prompt = stats["prompt_tokens"]
        self.cache_hit_rate.set(stats["cached_tokens"] / prompt if prompt else 0.0)
        programs = info.get("programs", {})
        for key, gauge in self.program_gauges.items():
            if key in programs:
                gauge.set(programs[key])
        by_program = {"all": programs.get("kv", {}), **{
            public_id: p["kv"] for public_id, p in programs.get("recent", {}).items()}}
        for key, gauge in self.program_kv_gauges.items():
            gauge.clear()  # programs no longer recent leave
            for label, counters in by_program.items():
                if key in counters:
                    gauge.labels(self._model_name, label).set(counters[key])
        for tier in ("host", "disk"):
            values = info.get("tiers", {}).get(tier)
            if values is not None:
                for key, gauge in self.tier_gauges.items():
                    gauge.labels(self._model_name, tier).set(values[key])

    def render(self) -> bytes:
        return generate_latest(self.registry)


def add_routes(app: FastAPI, tm: TokenizerManager) -> None:
    metrics = tm.metrics = Metrics(tm.served_model_name)

    @app.get("/metrics")
    async def get_metrics() -> Response:
        info = await tm.control("server_info")
        metrics.set_scheduler_state(info.data)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)
