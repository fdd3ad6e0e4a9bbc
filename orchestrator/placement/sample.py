"""Power of two choices (Sparrow's `p2c` strategy): ask two sampled workers instead of the region.

Asking d=2 random workers and taking the better answer gets most of the benefit of asking all of
them, with O(1) fan-out however big the region. The rng is injected, so a test or a simulation
replays the same samples from a seed.
"""

from __future__ import annotations

import random

CHOICES = 2


def sample_two(live_workers: list[str], rng: random.Random) -> list[str]:
    """Two distinct workers drawn with `rng`, or all of them (sorted) when there are fewer than two.

    The pool is de-duplicated and sorted first, so the sample depends only on the seed and the set of
    workers, not on the order the registry happened to list them in.
    """
    pool = sorted(set(live_workers))
    if len(pool) <= CHOICES:
        return pool
    return rng.sample(pool, CHOICES)
