"""Placement policy as data: desirability curves and weights, validated once, at the edge.

Placement scores a worker by how full it would be AFTER the new machine lands, through one
piecewise-linear curve per resource: a list of `(utilization, score)` points, utilization in [0, 1],
linear between points and flat (clamped) outside them. A curve says in one line what a policy is:
rising means bin packing, falling means spreading, a peak means "fill up to here, then back off".

Everything tunable lives in `PlacementConfig`, a frozen Struct, so a policy can come from a file
(`PlacementConfig.from_mapping`), be compared, logged and explained, and the scoring functions stay
pure. Validation runs in `__post_init__`, so a config built in code is checked exactly like one read
from a file, and each error is one line naming the bad key.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

import msgspec

Point = tuple[float, float]
Curve = tuple[Point, ...]

# CPU is compressible: a shared CPU that is 100% booked throttles, it does not kill, so a full
# worker still scores above an empty one.
DEFAULT_CPU_CURVE: Curve = ((0.0, 0.2), (0.7, 1.0), (1.0, 0.6))
# Memory is not compressible: past the peak it backs off harder, because an offer is stale the
# moment it is sent (racing brokers) and a worker at 100% has nothing left for bursts or spares.
DEFAULT_MEMORY_CURVE: Curve = ((0.0, 0.2), (0.7, 1.0), (1.0, 0.4))

CURVE_KEYS = ("cpu_curve", "memory_curve")
WEIGHT_KEYS = ("cpu_weight", "memory_weight", "image_bonus", "spread_penalty", "load_weight", "away_penalty")


class PlacementConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How placement weighs workers; every field is a key of `from_mapping`.

    Why the defaults:

    - Curves peak at 70% utilization (after placement). Pure bin packing (a rising curve) crams
      workers until the reservation race and memory bursts fail; pure spreading (a falling curve)
      leaves every worker half full, so a big guest fits nowhere. The peak keeps ~30% headroom and
      still fills workers before waking empty ones; an empty worker (0.2) remains a fine choice.
    - `cpu_weight` = `memory_weight` = 1.0: neither resource dominates by default.
    - `image_bonus` 0.25 per cached image: skipping a pull is worth about 20 points of utilization
      on one curve; enough to win a near tie, not enough to overfill a worker.
    - `spread_penalty` 0.5 per machine of the same app already on the worker: anti-affinity, so one
      worker's loss takes as few of an app's machines as the region allows. It must beat what the
      curves give for filling a worker further (placing a second 1-cpu guest on a 4-cpu worker gains
      about 0.3), so an app's machines land on distinct workers while there are free ones, and only
      share a worker when the others are much worse off (full or far past the peak).
    - `away_penalty` 10 on a worker the create would rather not get (`prefer_away`): more than the curves,
      the image bonus and any likely spread penalty together, so it only wins when nothing else can.
    - `load_weight` 0.1 per unit of `Offer.load` (load average per cpu; workers decline at 8 by
      default): a busy host loses ties against an idle one with the same bookings.
    """

    cpu_curve: Curve = DEFAULT_CPU_CURVE
    memory_curve: Curve = DEFAULT_MEMORY_CURVE
    cpu_weight: float = 1.0
    memory_weight: float = 1.0
    image_bonus: float = 0.25
    spread_penalty: float = 0.5
    load_weight: float = 0.1
    away_penalty: float = 10.0

    def __post_init__(self) -> None:
        for key in CURVE_KEYS:
            _check_curve(key, getattr(self, key))
        for key in WEIGHT_KEYS:
            _check_weight(key, getattr(self, key))

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, object]) -> PlacementConfig:
        """A config from plain data (a TOML table, a JSON object); missing keys keep their defaults.

        Curves are lists of `[utilization, score]` pairs. Raises ValueError naming the bad key.
        """
        values: dict[str, Any] = {}
        for key, value in mapping.items():
            if key in CURVE_KEYS:
                values[key] = _parse_curve(key, value)
            elif key in WEIGHT_KEYS:
                values[key] = _parse_number(key, value)
            else:
                raise ValueError(f"placement config: unknown key {key!r}")
        return cls(**values)


# Named policies an app picks with `[placement] preset = ...` in fauxmad.toml (CreateRequest.placement_preset).
# Each is the broker's config with its curves replaced, so the weights an operator tuned still apply.
PRESETS: dict[str, dict[str, Curve]] = {
    # the defaults: fill a worker up to 70%, then back off (see PlacementConfig)
    "balanced": {"cpu_curve": DEFAULT_CPU_CURVE, "memory_curve": DEFAULT_MEMORY_CURVE},
    # pack: the fuller a worker would be, the better, so empty workers stay empty (for big guests, or to
    # switch hosts off); memory still dips at the very top, since a full worker has nothing for bursts
    "binpack": {"cpu_curve": ((0.0, 0.0), (1.0, 1.0)), "memory_curve": ((0.0, 0.0), (0.95, 1.0), (1.0, 0.8))},
    # spread: the emptier, the better, so load and failures are shared as widely as the region allows
    "spread": {"cpu_curve": ((0.0, 1.0), (1.0, 0.0)), "memory_curve": ((0.0, 1.0), (1.0, 0.0))},
}


def with_preset(config: PlacementConfig, preset: str | None) -> PlacementConfig:
    """`config` with the curves of a named preset (`None`: unchanged). Raises ValueError for an unknown name."""
    if preset is None:
        return config
    curves = PRESETS.get(preset)
    if curves is None:
        raise ValueError(f"placement preset {preset!r} is unknown: use one of {', '.join(sorted(PRESETS))}")
    return msgspec.structs.replace(config, **curves)


def interpolate(curve: Curve, utilization: float) -> float:
    """The curve's score at `utilization`: linear between points, clamped outside the first and last.

    A linear scan: curves have a handful of points, fewer than a bisect's overhead pays for.
    """
    prev_u, prev_score = curve[0]
    if utilization <= prev_u:
        return prev_score
    for u, score in curve[1:]:
        if utilization <= u:
            return prev_score + (score - prev_score) * (utilization - prev_u) / (u - prev_u)
        prev_u, prev_score = u, score
    return prev_score


def _fail(key: str, problem: str) -> ValueError:
    return ValueError(f"placement config: {key}: {problem}")


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _parse_number(key: str, value: object) -> float:
    if not _is_number(value):
        raise _fail(key, f"expected a number, got {value!r}")
    return float(value)


def _parse_curve(key: str, value: object) -> Curve:
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        raise _fail(key, f"expected a list of [utilization, score] points, got {value!r}")
    points: list[Point] = []
    for point in value:
        if not isinstance(point, Sequence) or len(point) != 2 or not all(_is_number(n) for n in point):
            raise _fail(key, f"each point must be [utilization, score], got {point!r}")
        points.append((float(point[0]), float(point[1])))
    return tuple(points)


def _check_curve(key: str, curve: Curve) -> None:
    if len(curve) < 2:
        raise _fail(key, f"needs at least 2 points, got {len(curve)}")
    for u, score in curve:
        if not (math.isfinite(u) and math.isfinite(score)):
            raise _fail(key, f"point ({u}, {score}) is not finite")
        if not 0.0 <= u <= 1.0:
            raise _fail(key, f"utilization {u} is outside [0, 1]")
    if any(a[0] >= b[0] for a, b in itertools.pairwise(curve)):
        raise _fail(key, "points must be sorted by strictly increasing utilization")


def _check_weight(key: str, weight: float) -> None:
    if not math.isfinite(weight) or weight < 0:
        raise _fail(key, f"must be a finite number >= 0, got {weight}")
