"""Latency statistics for `fauxmad bench`: percentiles by the nearest-rank method, in milliseconds."""

from __future__ import annotations

import math

import msgspec


class Latency(msgspec.Struct, kw_only=True):
    count: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    mean_ms: float


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def summarize(seconds: list[float]) -> Latency:
    values = sorted(s * 1000 for s in seconds)
    return Latency(
        count=len(values),
        p50_ms=round(percentile(values, 50), 3),
        p90_ms=round(percentile(values, 90), 3),
        p99_ms=round(percentile(values, 99), 3),
        max_ms=round(values[-1], 3) if values else 0.0,
        mean_ms=round(sum(values) / len(values), 3) if values else 0.0,
    )
