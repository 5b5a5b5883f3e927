# %% [markdown]
# # Server metrics
#
# > `/metrics` in Prometheus' text format: latency histograms, token and request counters, and the engine's load as gauges.

# %%
#| default_exp server.metrics

# %%
#| export
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from forge_engine.engine import EngineStats, RequestOutput

# %%
#| hide
from prometheus_client.parser import text_string_to_metric_families

# %% [markdown]
# `/metrics` speaks Prometheus' text format. Latencies are histograms (so a dashboard can
# read p50 and p99), token and request counts are counters (they only grow), and the
# engine's load is a set of gauges read from its stats snapshot at scrape time. Each server
# has its own registry: no process-global state, so two apps in one process (a notebook,
# the tests) do not mix their numbers.

# %%
#| export
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


class ServerMetrics:
    "The Prometheus metrics of one server, in a registry of its own."

    def __init__(self):
        self.registry = r = CollectorRegistry()
        histogram = lambda name, doc: Histogram(name, doc, buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = histogram(
            "forge_time_to_first_token_seconds", "Arrival to first generated token."
        )
        self.itl = histogram(
            "forge_inter_token_latency_seconds", "Time between two outputs of one request."
        )
        self.e2e = histogram("forge_e2e_request_latency_seconds", "Arrival to last token.")
        self.queue = histogram("forge_request_queue_time_seconds", "Arrival to first scheduled.")
        self.prompt_tokens = Counter(
            "forge_prompt_tokens", "Prompt tokens of requests that started generating.", registry=r
        )
        self.generation_tokens = Counter("forge_generation_tokens", "Generated tokens.", registry=r)
        self.requests = Counter(
            "forge_requests", "Finished requests by finish reason.", ["finish_reason"], registry=r
        )
        for reason in FINISH_REASONS:
            self.requests.labels(reason)  # every series exists from the start
        self.running = Gauge("forge_requests_running", "Requests being decoded.", registry=r)
        self.waiting = Gauge("forge_requests_waiting", "Requests queued for admission.", registry=r)
        self.kv_used = Gauge(
            "forge_kv_cache_used_blocks", "KV blocks held by requests.", registry=r
        )
        self.kv_usage = Gauge(
            "forge_kv_cache_usage_ratio", "Fraction of KV blocks held by requests.", registry=r
        )
        self.grammar_time = Histogram(  # (a grammar from the cache takes ~0.05 ms, a compile 1 ms to seconds)
            "forge_grammar_compile_seconds",
            "Time to get a structured output's grammar: compiled, or copied from the cache (chapter 06a).",
            buckets=(0.0001, 0.001, 0.01, 0.1, 1.0, 10.0),
            registry=r,
        )
        self.prefix_hit_rate = Gauge(
            "forge_prefix_cache_hit_rate",
            "Prompt tokens found in the prefix cache / looked up.",
            registry=r,
        )
        # speculative decoding (chapter 08c): the engine's totals, read at scrape time
        self.spec_drafts = Gauge(
            "forge_spec_decode_draft_tokens", "Draft tokens proposed so far.", registry=r
        )
        self.spec_accepted = Gauge(
            "forge_spec_decode_accepted_tokens",
            "Draft tokens the model agreed with so far.",
            registry=r,
        )
        self.spec_steps = Gauge(
            "forge_spec_decode_verify_steps", "Sequences' verify steps so far.", registry=r
        )
        self.spec_acceptance = Gauge(
            "forge_spec_decode_acceptance_rate", "Accepted / proposed draft tokens.", registry=r
        )
        self.spec_length = Gauge(
            "forge_spec_decode_mean_accepted_length",
            "Tokens a verify step gave its sequence, on average (accepted drafts + 1).",
            registry=r,
        )

    def observe(self, out: RequestOutput, since_last_tokens: float | None) -> None:
        "One output of a request; `since_last_tokens`: seconds since its previous output with tokens."
        if out.delta_token_ids:
            self.generation_tokens.inc(len(out.delta_token_ids))
            if since_last_tokens is not None:
                self.itl.observe(since_last_tokens)
        if out.finished:
            self.requests.labels(out.finish_reason).inc()
            for histogram, key in (
                (self.queue, "queue_s"),
                (self.ttft, "ttft_s"),
                (self.e2e, "e2e_s"),
            ):
                if key in out.metrics:
                    histogram.observe(out.metrics[key])

    def exposition(self, stats: EngineStats | None) -> bytes:
        "The text format, with the gauges read from `stats` (None: the engine is not there yet)."
        if stats is not None:
            self.running.set(stats.running)
            self.waiting.set(stats.waiting)
            self.kv_used.set(stats.kv.used_blocks)
            self.kv_usage.set(stats.kv.usage)
            self.prefix_hit_rate.set(stats.kv.hit_rate)
            spec = stats.speculation
            self.spec_drafts.set(spec.proposed)
            self.spec_accepted.set(spec.accepted)
            self.spec_steps.set(spec.verified)
            self.spec_acceptance.set(spec.acceptance_rate)
            self.spec_length.set(spec.mean_accepted_length)
        return generate_latest(self.registry)


# %%
metrics = ServerMetrics()
metrics.observe(RequestOutput("a", None, [1], "", [5], delta_token_ids=[5]), None)
metrics.observe(
    RequestOutput(
        "a",
        None,
        [1],
        "",
        [5, 6],
        finished=True,
        finish_reason="length",
        delta_token_ids=[6],
        metrics={"queue_s": 0.01, "ttft_s": 0.2, "e2e_s": 0.3},
    ),
    0.05,
)
families = {f.name: f for f in text_string_to_metric_families(metrics.exposition(None).decode())}
assert (
    families["forge_generation_tokens"].type == "counter"
    and families["forge_generation_tokens"].samples[0].value == 2
)
assert families["forge_time_to_first_token_seconds"].type == "histogram"
assert families["forge_requests_running"].type == "gauge"
assert families["forge_grammar_compile_seconds"].type == "histogram"
by_reason = {
    s.labels["finish_reason"]: s.value
    for s in families["forge_requests"].samples
    if s.name.endswith("_total")
}
assert by_reason == {"stop": 0, "length": 1, "abort": 0, "error": 0}
itl_count = [
    s.value
    for s in families["forge_inter_token_latency_seconds"].samples
    if s.name.endswith("_count")
]
assert itl_count == [1]

# %% [markdown]
# The engine's gauges come from its stats snapshot at scrape time, speculative decoding's among them:

# %%
from types import SimpleNamespace

from forge_engine.speculative import SpeculationCounts

snapshot = SimpleNamespace(
    running=1,
    waiting=2,
    kv=SimpleNamespace(used_blocks=3, usage=0.25, hit_rate=0.5),
    speculation=SpeculationCounts(proposed=8, accepted=6, verified=2),
)
values = {
    f.name: f.samples[0].value
    for f in text_string_to_metric_families(ServerMetrics().exposition(snapshot).decode())
    if f.type == "gauge"
}
assert values["forge_requests_waiting"] == 2 and values["forge_kv_cache_usage_ratio"] == 0.25
assert values["forge_spec_decode_acceptance_rate"] == 0.75
assert values["forge_spec_decode_mean_accepted_length"] == 4.0
assert values["forge_spec_decode_draft_tokens"] == 8
