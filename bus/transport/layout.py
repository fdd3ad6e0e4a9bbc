"""Where the fleet's JetStream state lives: on one server (the default), or region by region in a supercluster.

On one server every bucket and stream is the one the contract names (`fauxmad_workers`, ...). In a
supercluster (`bus.local.supercluster`: a NATS cluster per region, joined by gateways) a region must keep working
when it is cut off from the others, so what a region writes about itself lives on its own servers: its
heartbeats, its routing index entries, its idempotency claims and its events go to a bucket or stream per
region, named after the contract's with `_<region>` appended, placed in the cluster named after the
region and replicated inside it. Nothing crosses regions on the write path, and no Raft group spans two
regions for them (JetStream's meta layer, which only creates and deletes streams and consumers, does).

The layout comes from `$FAUXMAD_SUPERCLUSTER` (the regions, comma-separated: `mad,syd,gru`; the first is
the home of the fleet-wide state: app specs, images, logs, audit) and `$FAUXMAD_REPLICAS` (default 3). With
neither set, nothing changes: the single-server names, R1, no placement.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import msgspec

from bus.contract import subjects

SUPERCLUSTER_ENV = "FAUXMAD_SUPERCLUSTER"
REPLICAS_ENV = "FAUXMAD_REPLICAS"


class Layout(msgspec.Struct, frozen=True):
    regions: tuple[str, ...] = ()  # empty: one server, the contract's names
    replicas: int = 1

    @property
    def supercluster(self) -> bool:
        return bool(self.regions)

    @property
    def home(self) -> str | None:
        """The region whose cluster holds the fleet-wide state (app specs, images, logs, audit)."""
        return self.regions[0] if self.regions else None

    def workers_bucket(self, region: str) -> str:
        return subjects.regional(subjects.WORKERS_BUCKET, region) if self.supercluster else subjects.WORKERS_BUCKET

    def machines_bucket(self, region: str) -> str:
        return subjects.regional(subjects.MACHINES_BUCKET, region) if self.supercluster else subjects.MACHINES_BUCKET

    def idempotency_bucket(self, region: str) -> str:
        if not self.supercluster:
            return subjects.IDEMPOTENCY_BUCKET
        return subjects.regional(subjects.IDEMPOTENCY_BUCKET, region)

    def events_stream(self, region: str) -> str:
        return subjects.regional(subjects.EVENTS_STREAM, region) if self.supercluster else subjects.EVENTS_STREAM

    def describe(self) -> str:
        if not self.supercluster:
            return "one server"
        return f"supercluster of {', '.join(self.regions)} (R{self.replicas} inside each, home {self.home})"


def from_env(environ: Mapping[str, str] = os.environ) -> Layout:
    """The layout `$FAUXMAD_SUPERCLUSTER` and `$FAUXMAD_REPLICAS` describe (one server when unset)."""
    text = environ.get(SUPERCLUSTER_ENV, "").strip()
    if not text:
        return Layout()
    regions = tuple(subjects.check_token("region", r.strip()) for r in text.split(",") if r.strip())
    replicas_text = environ.get(REPLICAS_ENV, "").strip() or "3"
    try:
        replicas = int(replicas_text)
    except ValueError:
        raise ValueError(f"${REPLICAS_ENV} must be 1, 3 or 5, not {replicas_text!r}") from None
    if replicas not in (1, 3, 5):
        raise ValueError(f"${REPLICAS_ENV} must be 1, 3 or 5, not {replicas}")
    return Layout(regions=regions, replicas=replicas)
