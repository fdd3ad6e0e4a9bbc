"""Latency statistics: percentiles by the nearest-rank method, in milliseconds, and ratios between them.

Nearest rank (no interpolation) so every reported percentile is a latency that was really observed.
"""

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
    """The nearest-rank `q`th percentile (0 < q <= 100) of values sorted ascending; 0.0 for none."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def summarize(seconds: list[float]) -> Latency:
    """Samples in seconds, summarized in milliseconds (rounded to the microsecond)."""
    values = sorted(s * 1000 for s in seconds)
    return Latency(
        count=len(values),
        p50_ms=round(percentile(values, 50), 3),
        p90_ms=round(percentile(values, 90), 3),
        p99_ms=round(percentile(values, 99), 3),
        max_ms=round(values[-1], 3) if values else 0.0,
        mean_ms=round(sum(values) / len(values), 3) if values else 0.0,
    )


def ratio(numerator: float, denominator: float) -> float | None:
    """`numerator / denominator` to two decimals; None when the denominator is not positive."""
    return round(numerator / denominator, 2) if denominator > 0 else None


class Ratio(msgspec.Struct, kw_only=True):
    """One latency over another, percentile by percentile (None where the other is 0)."""

    p50: float | None
    p99: float | None


def ratios(a: Latency, b: Latency) -> Ratio:
    return Ratio(p50=ratio(a.p50_ms, b.p50_ms), p99=ratio(a.p99_ms, b.p99_ms))
