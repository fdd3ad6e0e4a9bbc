"""Who moves an app's machines, and how far: the one rule the operator and the edge proxy both follow.

An app's desired state in a region is a range, not a number, once its `[http_service]` lets the edge act:

- **how many exist**: at least the release's count (`regions`); the operator creates up to it. Above it,
  only the edge's `auto_create` adds machines, up to `max_per_region`; the operator destroys only what is
  past the larger of the two.
- **how many run**: with `auto_stop`, the edge decides, above a floor of `min_machines_running` (per
  region, at most the count): it stops idle machines down to the floor and starts them again for traffic;
  the operator only starts resting primaries while the region is below the floor. Without `auto_stop`
  every primary runs, and the operator starts any that rests.

Both sides read the range from here, so they cannot disagree about it: before this rule, the operator
started every machine the edge had stopped (three seconds later) and destroyed every machine the edge had
created (a tenth of a second later). A lost host is still the operator's: its machines are replaced, in
the state they were in when the edge runs them (a stopped one is replaced stopped).
"""

from __future__ import annotations

import msgspec

from orchestrator.apps.http_service import HttpService

# who made a machine, kept in its config's metadata (so in its `created` event) and shown by `machine show`
CREATED_BY_KEY = "fauxmad_created_by"  # deploy | failover | drain | spare | proxy
CREATED_FOR_KEY = "fauxmad_created_for"  # the reason, in words: "mad has 1 of 2 machines"
MAX_REASON = 200  # characters of the reason kept

RUNNING = ("started", "starting")  # a machine counted as running, by the planner and the edge alike


class RegionRange(msgspec.Struct, frozen=True, kw_only=True):
    """What an app may have in one region, and who decides within it."""

    count: int  # machines the release places: the operator creates up to it
    most: int  # machines the region may hold: above `count` only by the edge's auto_create
    keep_running: int  # started machines kept: the operator starts resting primaries below it
    edge_runs: bool  # the edge decides which machines run (auto_stop); else every primary runs

    def to_start(self, running: int, resting: int) -> int:
        """How many of `resting` primaries the operator starts when `running` machines of the region run."""
        if not self.edge_runs:
            return resting  # every primary runs
        return min(resting, max(0, self.keep_running - running))

    def to_stop(self, running: int) -> int:
        """How many idle machines the edge may stop when `running` machines of the region run."""
        return max(0, running - self.keep_running) if self.edge_runs else 0

    def may_create(self, existing: int) -> bool:
        """Whether the edge may create one more machine where `existing` machines are."""
        return existing < self.most

    def too_many(self, existing: int) -> int:
        """How many machines the operator destroys where `existing` primaries are."""
        return max(0, existing - self.most)


def region_range(count: int, service: HttpService | None) -> RegionRange:
    """The range of a region whose release places `count` machines, under the app's `[http_service]`."""
    if service is None:
        return RegionRange(count=count, most=count, keep_running=count, edge_runs=False)
    edge_runs = service.auto_stop != "off"
    most = max(count, service.max_per_region) if service.auto_create else count
    keep = min(service.min_machines_running, count) if edge_runs else count
    return RegionRange(count=count, most=most, keep_running=keep, edge_runs=edge_runs)
