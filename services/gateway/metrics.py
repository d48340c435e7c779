"""/metrics: vLLM's metric names under `tokenline:`.

Latency histograms come from the event times the tracker stamps as outputs arrive (arrival,
first token, each token, finish) on one monotonic clock, and the queue time the scheduler
measures; they observe requests that completed (stop or length), so an abort or an error moves
`request_success_total{finished_reason}` (and an abort the scheduler's abort counter), never a
latency.
Scheduler gauges and counters come from the schedulers' heartbeats (StatsOut), summed over
instances, read at scrape time.
"""

from __future__ import annotations

import time
from collections import Counter as PyCounter
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from common.messages import GRAMMAR_COMPILE_BUCKETS, TextOut

if TYPE_CHECKING:
    from common.messages import StatsOut
    from common.peers import PeerTable
    from services.gateway.tracker import SubRequest, Tracker

P = "tokenline:"
ROUTE_REASONS = ("queue_group", "cache_hit", "cache_miss", "imbalance", "round_robin",
                 "shortest_queue", "fallback")
SERVICES = ("gateway", "tokenizer", "scheduler", "detokenizer")
RESUME_REASONS = ("gap", "stalled", "scheduler_lost")  # failover.py's
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)


class _SchedulerCollector:
    """Gauges and counters from the latest heartbeat of every live scheduler."""

    GAUGES = {
        "num_requests_running": ("num_running", "Requests in the running batch."),
        "num_requests_waiting": ("num_waiting", "Requests waiting to be scheduled."),
        "kv_cache_usage_perc": ("kv_usage", "Fraction of KV blocks in use (1 = full)."),
        "kv_cache_free_blocks": ("kv_free_blocks", "KV blocks free."),
        "kv_cache_cached_blocks": ("kv_cached_blocks", "Unreferenced blocks held by the "
                                                       "prefix cache."),
        "kv_cache_total_blocks": ("kv_total_blocks", "KV blocks in the pool."),
    }
    COUNTERS = {
        "num_retractions": ("num_retractions_total", "Requests retracted when KV ran out."),
        "num_requests_aborted": ("num_aborted_total", "Requests aborted."),
        "prompt_tokens": ("prompt_tokens_total", "Prompt tokens received."),
        "generation_tokens": ("generation_tokens_total", "Tokens generated."),
        "prefix_cache_queries": ("prefix_cache_queries_total", "Prompt tokens looked up in the "
                                                               "prefix cache."),
        "prefix_cache_hits": ("prefix_cache_hits_total", "Prompt tokens found in the prefix "
                                                         "cache."),
        "router_predicted_cached_tokens": ("routed_predicted_tokens_total", "Prompt tokens the "
                                           "router expected the scheduler it picked to hold."),
        "router_cached_tokens": ("routed_cached_tokens_total", "Prompt tokens those routed "
                                 "requests found cached there (over the predicted: accuracy)."),
        "structured_output_requests": ("grammar_requests_total", "Requests with an output "
                                       "constraint (JSON schema, regex, choice, EBNF, tools)."),
        "grammar_cache_hits": ("grammar_cache_hits_total", "Constraints whose grammar was "
                                                           "already compiled."),
        "spec_decode_num_drafts": ("spec_num_drafts_total", "Speculative verifies: a request's "
                                   "drafts scored in one step."),
        "spec_decode_num_draft_tokens": ("spec_num_draft_tokens_total", "Draft tokens proposed "
                                         "and verified."),
        "spec_decode_num_accepted_tokens": ("spec_num_accepted_tokens_total", "Draft tokens "
                                            "accepted (over draft tokens: the acceptance rate)."),
    }

    SETUP = ("quantization", "dtype", "linear_dtype", "device")  # scheduler_info's labels

    def __init__(self, model_name: str, peers: PeerTable, tracker: Tracker) -> None:
        self.model_name = model_name
        self.peers = peers
        self.tracker = tracker

    def collect(self):
        scheds = self.peers.alive("scheduler")
        for name, (field, doc) in self.GAUGES.items():
            g = GaugeMetricFamily(P + name, doc, labels=["model_name"])
            values = [getattr(s, field) for s in scheds]
            if field == "kv_usage":
                value = sum(values) / len(values) if values else 0.0
            else:
                value = sum(values)
            g.add_metric([self.model_name], value)
            yield g
        for name, (field, doc) in self.COUNTERS.items():
            c = CounterMetricFamily(P + name, doc, labels=["model_name"])
            # dead schedulers' last counts stay in: counters never go down on a scrape
            c.add_metric([self.model_name],
                         sum(getattr(s, field) for s in self.peers.known("scheduler")))
            yield c
        yield self._router_decisions()
        yield self._compile_times()
        yield self._accepted_per_pos()
        yield from self._lora(scheds)
        inflight = GaugeMetricFamily(P + "requests_in_flight",
                                     "Requests each service holds state for (leaks show here).",
                                     labels=["model_name", "service"])
        inflight.add_metric([self.model_name, "gateway"], len(self.tracker))
        for svc in ("tokenizer", "scheduler", "detokenizer"):
            inflight.add_metric([self.model_name, svc],
                                sum(s.in_flight for s in self.peers.alive(svc)))
        yield inflight
        # an info metric, like vLLM's cache_config_info: value 1, the facts in the labels
        setup = GaugeMetricFamily(P + "scheduler_info", "Each live scheduler's model setup.",
                                  labels=["model_name", "instance_id", *self.SETUP])
        for s in scheds:
            info = s.info or {}
            setup.add_metric([self.model_name, s.instance_id,
                              info.get("quantization", {}).get("mode", "none"),
                              info.get("dtype", ""), info.get("linear_dtype", ""),
                              info.get("device", "")], 1)
        yield setup

    def _router_decisions(self) -> CounterMetricFamily:
        decisions = CounterMetricFamily(P + "router_decisions", "Requests routed to a "
                                        "scheduler, by reason (cache_hit, cache_miss, "
                                        "imbalance, fallback, queue_group, ...).",
                                        labels=["model_name", "reason"])
        by_reason: dict[str, int] = {}
        for s in self.peers.known("tokenizer"):
            for reason, n in (s.route_decisions_total or {}).items():
                by_reason[reason] = by_reason.get(reason, 0) + n
        # every reason from the start, at 0: a fresh server serves what the dashboard queries
        for reason in ROUTE_REASONS:
            by_reason.setdefault(reason, 0)
        for reason, n in sorted(by_reason.items()):
            decisions.add_metric([self.model_name, reason], n)
        return decisions

    def _lora(self, scheds: list[StatsOut]):
        """vLLM's lora_requests_info (an info metric: value 1, the adapters' names in its
        labels, comma-separated, over every live scheduler), and requests per adapter."""
        running: PyCounter[str] = PyCounter()
        waiting: PyCounter[str] = PyCounter()
        for s in scheds:
            running.update(s.lora_running or {})
            waiting.update(s.lora_waiting or {})
        info = GaugeMetricFamily(P + "lora_requests_info", "Running and waiting LoRA "
                                 "adapters, and --max-loras-per-batch.",
                                 labels=["model_name", "max_lora", "running_lora_adapters",
                                         "waiting_lora_adapters"])
        info.add_metric([self.model_name, str(max((s.max_lora for s in scheds), default=0)),
                         ",".join(sorted(running)), ",".join(sorted(waiting))], 1)
        yield info
        per = GaugeMetricFamily(P + "lora_requests", "Requests per LoRA adapter, running or "
                                "waiting.", labels=["model_name", "lora_name", "state"])
        for state, counts in (("running", running), ("waiting", waiting)):
            for name, n in sorted(counts.items()):
                per.add_metric([self.model_name, name, state], n)
        yield per

    def _accepted_per_pos(self) -> CounterMetricFamily:
        """Accepted drafts by their position in the proposal (vLLM's per-position counter)."""
        c = CounterMetricFamily(P + "spec_decode_num_accepted_tokens_per_pos", "Draft tokens "
                                "accepted, by position in their proposal (0: the first).",
                                labels=["model_name", "position"])
        totals: list[int] = []
        for s in self.peers.known("scheduler"):
            for pos, n in enumerate(s.spec_accepted_per_pos_total or []):
                totals += [0] * (pos + 1 - len(totals))
                totals[pos] += n
        for pos, n in enumerate(totals or [0]):  # served at 0 before any speculation
            c.add_metric([self.model_name, str(pos)], n)
        return c

    def _compile_times(self) -> HistogramMetricFamily:
        """Grammar compile times, every scheduler's (dead ones' too: counts never go down)."""
        scheds = self.peers.known("scheduler")
        counts = [0] * (len(GRAMMAR_COMPILE_BUCKETS) + 1)
        for s in scheds:
            for i, n in enumerate(s.grammar_compile_buckets[: len(counts)]):
                counts[i] += n
        buckets, total = [], 0
        for bound, n in zip([*map(str, GRAMMAR_COMPILE_BUCKETS), "+Inf"], counts, strict=True):
            total += n
            buckets.append((bound, total))
        h = HistogramMetricFamily(P + "grammar_compile_seconds", "Time to compile a request's "
                                  "grammar (cache misses only).", labels=["model_name"])
        h.add_metric([self.model_name], buckets,
                     sum(s.grammar_compile_seconds_sum for s in scheds))
        return h


class _FailoverCollector:
    """NATS reconnects and round trips by service (the gateway's own client, the others'
    heartbeats; dead instances' last reconnect count too) and requests resumed, by why."""

    def __init__(self, model_name: str, peers: PeerTable, resumed: PyCounter[str],
                 own_bus: Callable[[], tuple[int, float]]) -> None:
        self.model_name = model_name
        self.peers = peers
        self.resumed = resumed
        self.own_reconnects = lambda: own_bus()[0]
        self.own_rtt = lambda: own_bus()[1]

    def collect(self):
        reconnects = CounterMetricFamily(P + "nats_reconnects", "Times a service's NATS client "
                                         "came back after its connection dropped (to a "
                                         "surviving node or the same one restarted).",
                                         labels=["model_name", "service"])
        for svc in SERVICES:
            n = self.own_reconnects() if svc == "gateway" else sum(
                s.nats_reconnects for s in self.peers.known(svc))
            reconnects.add_metric([self.model_name, svc], n)
        yield reconnects
        rtt = GaugeMetricFamily(P + "nats_rtt_seconds", "Each service's last PING/PONG with its "
                                "NATS node (the slowest live instance): a hop through NATS "
                                "costs the sender's half and the receiver's half of it, plus a "
                                "route between nodes.", labels=["model_name", "service"])
        for svc in SERVICES:
            rtt.add_metric([self.model_name, svc], self.own_rtt() if svc == "gateway" else max(
                (s.nats_rtt_s for s in self.peers.alive(svc)), default=0.0))
        yield rtt
        resumed = CounterMetricFamily(P + "requests_resumed", "Requests resumed after the "
                                      "tokens their client had: output lost on a NATS node "
                                      "that died (gap, stalled) or a scheduler lost.",
                                      labels=["model_name", "reason"])
        for why in RESUME_REASONS:
            resumed.add_metric([self.model_name, why], self.resumed[why])
        yield resumed


class Metrics:
    def __init__(self, model_name: str, peers: PeerTable, tracker: Tracker,
                 resumed: PyCounter[str] | None = None,
                 own_bus: Callable[[], tuple[int, float]] = lambda: (0, 0.0)) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.model_name = model_name

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(P + name, doc, labels, buckets=LATENCY_BUCKETS,
                             registry=self.registry)

        self.ttft = hist("time_to_first_token_seconds", "Time to the first token.")
        self.itl = hist("inter_token_latency_seconds", "Time between outputs of a request.")
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.")
        self.queue = hist("request_queue_time_seconds", "Time waiting in the scheduler.")
        for h in (self.ttft, self.itl, self.e2e, self.queue):  # present from the start, empty
            h.labels(model_name)
        self.success = Counter(P + "request_success", "Requests ended, by finish reason "
                               "(stop, length, abort, error).", ["model_name", "finished_reason"],
                               registry=self.registry)
        for reason in ("stop", "length", "abort", "error"):  # present from the start, at 0
            self.success.labels(model_name, reason)
        self.registry.register(_SchedulerCollector(model_name, peers, tracker))
        self.registry.register(_FailoverCollector(model_name, peers,
                                                  PyCounter() if resumed is None else resumed,
                                                  own_bus))

    def observe_finished(self, sub: SubRequest, out: TextOut) -> None:
        """A sequence's final output (stop, length or abort) as the handler consumes it."""
        m = self.model_name
        kind = out.finish.kind if out.finish is not None else "abort"
        self.success.labels(m, kind).inc()
        if kind not in ("stop", "length"):
            return
        end = sub.finished_at if sub.finished_at is not None else time.monotonic()
        self.e2e.labels(m).observe(end - sub.arrival)
        if sub.first_token is not None:
            self.ttft.labels(m).observe(sub.first_token - sub.arrival)
        for gap in sub.itls:
            self.itl.labels(m).observe(gap)
        if sub.queue_time is not None:
            self.queue.labels(m).observe(sub.queue_time)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def observe_ended_early(self, n: int, failed: bool) -> None:
        """Sequences that ended unfinished: with an error response to the client (`failed`: a
        stage refused or lost them, no output in time), else aborted (the client went away)."""
        self.success.labels(self.model_name, "error" if failed else "abort").inc(n)
