"""Metric math of the serving benchmark, kept free of I/O so that it can be unit-tested.

Definitions follow `vllm bench serve`:
- TTFT: request sent -> first non-empty content chunk.
- ITL: gaps between consecutive content chunks (a chunk may carry several tokens).
- E2EL: request sent -> end of stream.
- TPOT: (E2EL - TTFT) / (output_tokens - 1), the mean decode pace of one request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

# The metrics printed and stored for each request, with the attribute that holds them.
LATENCY_METRICS: tuple[tuple[str, str], ...] = (
    ("ttft", "Time to First Token"),
    ("tpot", "Time per Output Token (excl. 1st token)"),
    ("itl", "Inter-token Latency"),
    ("e2el", "End-to-end Latency"),
)
GOODPUT_METRICS: tuple[str, ...] = ("ttft", "tpot", "e2el")


@dataclass
class RequestOutput:
    """What one request measured; times are seconds on the client's monotonic clock."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    cached_tokens: int = 0  # prompt tokens the server found in its prefix cache (its usage)
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0  # send time, relative to the benchmark's start
    generated_text: str = ""

    @property
    def tpot(self) -> float:
        # A one-token answer has no decode phase; vLLM counts its TPOT as 0 so that it
        # passes a TPOT SLO rather than being dropped from goodput.
        if self.output_tokens <= 1:
            return 0.0
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def percentile(values: list[float] | np.ndarray, p: float) -> float:
    """Linear-interpolated percentile (numpy's default); 0.0 for no values, as vLLM prints."""
    if len(values) == 0:
        return 0.0
    return float(np.percentile(np.asarray(values, dtype=np.float64), p))


def percentile_key(p: float) -> str:
    """`99` -> `p99`, `99.9` -> `p99.9`: the suffix used in metric names."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def parse_percentiles(text: str) -> list[float]:
    values = [float(x) for x in text.split(",") if x.strip()]
    for p in values:
        if not 0 <= p <= 100:
            raise ValueError(f"percentile {p} is outside [0, 100]")
    return values


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """`["ttft:200", "tpot:50"]` -> `{"ttft": 200.0, "tpot": 50.0}` (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(
                f"bad goodput SLO {item!r}: expected NAME:MS with NAME in {GOODPUT_METRICS}"
            )
        ms = float(value)
        if ms < 0:
            raise ValueError(f"bad goodput SLO {item!r}: negative milliseconds")
        slos[name] = ms
    return slos


def meets_slos(out: RequestOutput, slos_ms: dict[str, float]) -> bool:
    """True when a successful request meets every given SLO (all in milliseconds)."""
    if not out.success:
        return False
    measured = {"ttft": out.ttft, "tpot": out.tpot, "e2el": out.e2el}
    return all(measured[name] * 1000.0 <= limit for name, limit in slos_ms.items())


def arrival_times(
    n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> np.ndarray:
    """Send offsets (seconds from the start) of n requests; the first goes at 0.

    Intervals are Gamma(shape=k, scale=1/(rate*k)): mean 1/rate whatever k, coefficient of
    variation 1/sqrt(k). k=1 is the exponential, i.e. a Poisson process; k<1 is burstier,
    k>1 steadier. An infinite rate sends everything at once.
    """
    if n <= 0:
        return np.zeros(0)
    if burstiness <= 0:
        raise ValueError("burstiness must be positive")
    if math.isinf(request_rate):
        return np.zeros(n)
    if request_rate <= 0:
        raise ValueError("request rate must be positive")
    rng = np.random.default_rng(seed)
    intervals = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(intervals)])


def compute_metrics(
    outputs: list[RequestOutput],
    duration_s: float,
    percentiles: list[float] | tuple[float, ...] = (99,),
    goodput_slos_ms: dict[str, float] | None = None,
) -> dict:
    """Aggregate per-request results into vLLM-named metrics (latencies in ms).

    Median and p99 are always present (the sweep plot uses them); other percentiles as asked.
    """
    ok = [o for o in outputs if o.success]
    total_input = sum(o.prompt_len for o in ok)
    total_output = sum(o.output_tokens for o in ok)
    total_cached = sum(o.cached_tokens for o in ok)
    duration = max(duration_s, 1e-9)
    metrics: dict = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "total_cached_tokens": total_cached,
        "cache_hit_rate": total_cached / total_input if total_input else 0.0,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
    }
    if goodput_slos_ms:
        good = sum(meets_slos(o, goodput_slos_ms) for o in ok)
        metrics["goodput_slos_ms"] = dict(goodput_slos_ms)
        metrics["good_requests"] = good
        metrics["request_goodput"] = good / duration

    samples: dict[str, list[float]] = {
        "ttft": [o.ttft for o in ok],
        # vLLM leaves one-token requests out of the TPOT distribution: they have no decode.
        "tpot": [o.tpot for o in ok if o.output_tokens > 1],
        "itl": [gap for o in ok for gap in o.itl],
        "e2el": [o.e2el for o in ok],
    }
    wanted = sorted(set(percentiles) | {99.0})
    for name, _ in LATENCY_METRICS:
        ms = np.asarray(samples[name], dtype=np.float64) * 1000.0
        metrics[f"mean_{name}_ms"] = float(ms.mean()) if ms.size else 0.0
        metrics[f"median_{name}_ms"] = percentile(ms, 50)
        metrics[f"std_{name}_ms"] = float(ms.std()) if ms.size else 0.0
        for p in wanted:
            metrics[f"{percentile_key(p)}_{name}_ms"] = percentile(ms, p)
    metrics["percentiles"] = list(percentiles)
    return metrics
