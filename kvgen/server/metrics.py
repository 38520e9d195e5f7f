"""Prometheus metrics of one server: request latencies and token counts as requests finish, and the
engine's queues, KV usage and cumulative cache counters read from `engine.stats()` at scrape time (or,
behind data-parallel replicas, from the readings the ReplicaSet hands up: the Prometheus formatting
stays here, so the replica layer knows nothing of the server).

Every app has its own CollectorRegistry, so several apps (tests) can live in one process.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvgen.engine.base import Engine, EngineStats
from kvgen.replicas.frontend import ReplicaSet
from kvgen.scheduling.sequence import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def stats_families(stats: EngineStats) -> Iterator[Metric]:
    """The gauges and engine-side counters of /metrics, from one reading of the engine's stats."""
    usage = stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0
    hit_rate = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
    yield GaugeMetricFamily("kvgen_num_requests_running", "Sequences being generated.", stats.num_running)
    yield GaugeMetricFamily("kvgen_num_requests_waiting", "Sequences waiting to be scheduled.", stats.num_waiting)
    yield GaugeMetricFamily("kvgen_kv_cache_blocks_used", "KV blocks held by sequences.", stats.kv_blocks_used)
    yield GaugeMetricFamily("kvgen_kv_cache_blocks_total", "KV blocks in the pool.", stats.kv_blocks_total)
    yield GaugeMetricFamily("kvgen_kv_cache_usage_ratio", "Fraction of KV blocks in use.", usage)
    yield GaugeMetricFamily("kvgen_prefix_cache_hit_rate",
                            "Fraction of looked-up prompt tokens served from the prefix cache.", hit_rate)
    yield CounterMetricFamily("kvgen_num_preemptions", "Sequences preempted for lack of KV blocks.",
                              stats.num_preemptions)
    yield CounterMetricFamily("kvgen_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                              stats.prefix_cache_queries)
    yield CounterMetricFamily("kvgen_prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                              stats.prefix_cache_hits)
    yield CounterMetricFamily("kvgen_spec_decode_num_draft_tokens", "Speculative tokens proposed and verified.",
                              stats.spec_proposed)
    yield CounterMetricFamily("kvgen_spec_decode_num_accepted_tokens", "Speculative tokens accepted.",
                              stats.spec_accepted)
    yield CounterMetricFamily("kvgen_spec_decode_num_verify_steps",
                              "Sequence-steps that verified speculative tokens.", stats.spec_verify_steps)
    yield from tier_families(stats)
    if stats.state_slots_total:
        yield from state_families(stats)
    yield from expert_families(stats)
    mean = (stats.spec_accepted + stats.spec_verify_steps) / stats.spec_verify_steps if stats.spec_verify_steps else 0.0
    yield GaugeMetricFamily("kvgen_spec_decode_mean_accepted_length",
                            "Tokens emitted per verifying sequence-step (accepted + the target's own).", mean)


def state_families(stats: EngineStats) -> Iterator[Metric]:
    """A recurrent model's state pool, apart from the KV blocks: a slot per running sequence, whatever its length."""
    yield GaugeMetricFamily("kvgen_state_slots_used", "Recurrent-state slots held by sequences.", stats.state_slots_used)
    yield GaugeMetricFamily("kvgen_state_slots_total", "Recurrent-state slots in the pool.", stats.state_slots_total)
    yield GaugeMetricFamily("kvgen_state_bytes_used", "Bytes of recurrent state the running sequences hold.",
                            stats.state_bytes_used)
    yield GaugeMetricFamily("kvgen_state_bytes_total", "Bytes of the state pool (slots, prefix snapshots, "
                            "verify checkpoints).", stats.state_bytes_total)
    yield GaugeMetricFamily("kvgen_state_snapshots", "Prefix-cache snapshots of the recurrent state kept.",
                            stats.state_snapshots)


def tier_families(stats: EngineStats) -> Iterator[Metric]:
    """Per KV tier below the pool (label `tier`: host, disk): what it holds, hits, bytes, seconds."""
    if not stats.kv_tiers:
        return
    held = GaugeMetricFamily("kvgen_kv_tier_blocks", "KV blocks held by a tier below the pool.", labels=["tier"])
    held_bytes = GaugeMetricFamily("kvgen_kv_tier_bytes_held", "Bytes held by a KV tier.", labels=["tier"])
    hits = CounterMetricFamily("kvgen_kv_tier_hits", "Prefix blocks loaded back into the pool from a tier.",
                               labels=["tier"])
    moved = CounterMetricFamily("kvgen_kv_tier_bytes", "Bytes written to (in) and read from (out) a tier.",
                                labels=["tier", "direction"])
    seconds = CounterMetricFamily("kvgen_kv_tier_seconds", "Seconds spent storing and loading a tier's blocks.",
                                  labels=["tier"])
    for tier, r in stats.kv_tiers:
        held.add_metric([tier], r["blocks"])
        held_bytes.add_metric([tier], r["bytes"])
        hits.add_metric([tier], r["hits"])
        moved.add_metric([tier, "in"], r["bytes_in"])
        moved.add_metric([tier, "out"], r["bytes_out"])
        seconds.add_metric([tier], r["seconds"])
    yield from (held, held_bytes, hits, moved, seconds)


def expert_families(stats: EngineStats) -> Iterator[Metric]:
    """A mixture of experts' router statistics: tokens routed to each expert of each MoE layer."""
    if not stats.expert_tokens:
        return
    tokens = CounterMetricFamily("kvgen_moe_expert_tokens", "Tokens the router sent to an expert of a layer.",
                                 labels=["layer", "expert"])
    for layer, counts in stats.expert_tokens:
        for expert, n in enumerate(counts):
            tokens.add_metric([str(layer), str(expert)], n)
    yield tokens


def labelled_families(readings: list[tuple[dict[str, str], EngineStats]]) -> Iterator[Metric]:
    """The families of `stats_families`, one sample per reading with that reading's labels (a
    data-parallel server's replicas: {"replica": "0"}, ...)."""
    merged: dict[str, Metric] = {}
    for labels, stats in readings:
        for family in stats_families(stats):
            into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            into.samples += [s._replace(labels={**s.labels, **labels}) for s in family.samples]
    return iter(merged.values())


class EngineStatsCollector(Collector):
    """Gauges and engine-side counters, read from the engine when scraped."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        return stats_families(self.engine.stats())


class ReplicaCollector(Collector):
    """/metrics of data-parallel replicas: the engine's gauges and counters per replica (label `replica`),
    each replica's state, and the router's decisions, from one reading of the ReplicaSet."""

    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas

    def collect(self) -> Iterator[Metric]:
        readings = self.replicas.readings()
        yield from labelled_families([({"replica": str(i)}, stats) for i, stats in enumerate(readings.stats)])
        live = GaugeMetricFamily("kvgen_replica_up", "1 while the replica serves requests.", labels=["replica"])
        restarted = CounterMetricFamily("kvgen_replica_restarts", "Times the replica was restarted after dying.",
                                        labels=["replica"])
        for index, (up, n) in enumerate(zip(readings.up, readings.restarts)):
            live.add_metric([str(index)], float(up))
            restarted.add_metric([str(index)], n)
        yield live
        yield restarted
        decisions = CounterMetricFamily("kvgen_router_requests", "Requests routed: by prefix match, by load "
                                        "(least loaded), or round_robin.", labels=["reason"])
        for reason, n in readings.routed.items():
            decisions.add_metric([reason], n)
        yield decisions


class ServerMetrics:
    """The registry of one app; the app reports each engine request's outputs and its end."""

    def __init__(self, engine: Engine, engine_collector: Collector | None = None) -> None:
        """`engine_collector` replaces the engine's own gauges and counters (a data-parallel server
        reports them per replica)."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("kvgen_time_to_first_token_seconds", "Time to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("kvgen_inter_token_latency_seconds", "Time between output tokens.",
                                     buckets=_TOKEN_GAP_BUCKETS, registry=r)
        self.e2e = Histogram("kvgen_e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kvgen_prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter("kvgen_generation_tokens", "Tokens generated.", registry=r)
        self.requests = Counter("kvgen_requests", "Completions finished, by finish reason.", ["finish_reason"],
                                registry=r)
        self.rejected = Counter("kvgen_requests_rejected", "Requests refused before admission: queue_full "
                                "(429, backpressure) or over_limit (400, a field over a server limit).", ["reason"],
                                registry=r)
        r.register(engine_collector or EngineStatsCollector(engine))
        self._own = (self.ttft, self.inter_token, self.e2e, self.prompt_tokens, self.generation_tokens,
                     self.requests, self.rejected)

    def on_start(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_output(self, out: RequestOutput) -> None:
        self.generation_tokens.inc(sum(len(c.new_token_ids) for c in out.outputs))
        if not out.finished:
            return
        m = out.metrics
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        steps = sorted(set(m.token_times))  # n > 1 completions get their tokens in the same steps
        for earlier, later in zip(steps, steps[1:]):
            self.inter_token.observe(later - earlier)
        if m.e2e_latency is not None:
            self.e2e.observe(m.e2e_latency)
        for completion in out.outputs:
            self.requests.labels(finish_reason=completion.finish_reason or "abort").inc()

    def on_reject(self, reason: str) -> None:
        self.rejected.labels(reason=reason).inc()

    def on_abort(self, num_completions: int) -> None:
        """A request that ended before finishing (its client went away)."""
        self.requests.labels(finish_reason="abort").inc(num_completions)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def values(self, stats: EngineStats) -> dict[str, float]:
        """Every /metrics sample by its exposition name (labels as in the text format), with the engine's
        part taken from `stats` (a reading from between two steps), plus p50/p90/p99 of each histogram."""
        values: dict[str, float] = {}
        families = [*stats_families(stats), *(f for m in self._own for f in m.collect())]
        for family in families:
            for sample in family.samples:
                if not sample.name.endswith("_created"):  # a timestamp, not a figure to show
                    values[_sample_key(sample.name, sample.labels)] = sample.value
            if family.type == "histogram":
                values.update(_quantiles(family))
        return values


def _sample_key(name: str, labels: dict[str, str]) -> str:
    if not labels:
        return name
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def _quantiles(family: Metric) -> dict[str, float]:
    """p50/p90/p99 of a histogram, interpolated inside its buckets as PromQL's histogram_quantile does
    (0 before any observation; the largest finite bound when the rank falls in the +Inf bucket)."""
    buckets = [(float(s.labels["le"]), s.value) for s in family.samples if s.name.endswith("_bucket")]
    total = buckets[-1][1]
    out = {}
    for q in (0.5, 0.9, 0.99):
        out[f"{family.name}_p{round(q * 100)}"] = _quantile(q, buckets, total)
    return out


def _quantile(q: float, buckets: list[tuple[float, float]], total: float) -> float:
    if total == 0:
        return 0.0
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / max(count - lower_count, 1e-12)
        lower_bound, lower_count = bound, count
    return lower_bound
