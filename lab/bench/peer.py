"""Side by side with a peer: Ray on the same machine, in the same run, at concurrency 1.

The pairs compare like with like. A fauxmad create that only reserves (`skip_launch`) against a Ray
placement group of one CPU bundle (a reservation, ready when the scheduler has committed it); a
fauxmad create+start (a process started by the worker) against a Ray actor of one CPU (a started
worker process, ready when it answers a method call). Each pair is timed from the request to the
answer, sequentially, after the same warm-up, and each reservation or actor is removed before the
next (fauxmad's reserve-only machines are never started; its started ones stay up until the fleet
stops, on workers with room for all of them).

The two systems run one after the other, never at once: first a fauxmad fleet (started, measured,
stopped), then a local Ray instance (`ray.init(num_cpus=2)`, no dashboard, shut down after). Ray is
the optional extra `peers` and is imported only here, at run time; without it `PeerMissing` says how
to install it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import uvloop

from lab.bench import BenchError
from lab.bench.placement import CreateRun, PlacementOptions, fleet_url, measure_creates
from lab.bench.report import Report, Table, host_info, latency_table, times
from lab.bench.stats import Latency, Ratio, ratios, summarize

INSTALL_HINT = "pip install -e '.[peers]'"


class PeerMissing(BenchError):
    """The peer to compare with is not installed."""


class PeerOptions(msgspec.Struct, frozen=True, kw_only=True):
    count: int = 200  # of each kind, measured
    warmup: int = 10  # of each kind, before measuring
    workers: int = 10  # fauxmad workers (one region)
    ray_cpus: int = 2  # what `ray.init(num_cpus=...)` gets
    timeout: float = 60.0  # per Ray operation


class PeerResult(msgspec.Struct, kw_only=True):
    count: int
    concurrency: int
    fauxmad_workers: int
    ray_version: str
    ray_cpus: int
    fauxmad_create: Latency
    fauxmad_create_start: Latency
    ray_placement_group: Latency
    ray_actor: Latency
    # fauxmad ÷ Ray, percentile by percentile: below 1, fauxmad answered sooner
    create_over_placement_group: Ratio
    create_start_over_actor: Ratio
    errors: dict[str, int]
    host: dict[str, object]
    first_error: str | None = None


class _Timed(msgspec.Struct, kw_only=True):
    samples: list[float]
    errors: int = 0
    first_error: str | None = None


def ray_available() -> bool:
    return importlib.util.find_spec("ray") is not None


def _import_ray() -> tuple[Any, Any]:
    """(ray, ray.util.placement_group), imported now; `PeerMissing` when Ray is not installed."""
    if not ray_available():
        raise PeerMissing(f"Ray is not installed: {INSTALL_HINT}")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage report, no prompt
    return importlib.import_module("ray"), importlib.import_module("ray.util.placement_group")


def _timed(what: Callable[[], object], *, warmup: int, count: int) -> _Timed:
    """Call `what` warmup+count times one after another; time the last `count` (failures counted apart)."""
    timed = _Timed(samples=[])
    for i in range(warmup + count):
        began = time.perf_counter()
        try:
            what()
        except Exception as exc:
            if i >= warmup:
                timed.errors += 1
                timed.first_error = timed.first_error or f"{type(exc).__name__}: {exc}"
            continue
        if i >= warmup:
            timed.samples.append(time.perf_counter() - began)
    return timed


@contextlib.contextmanager
def _local_ray(ray: Any, cpus: int) -> Iterator[None]:
    temp_dir = tempfile.mkdtemp(prefix="fauxmad-ray-")
    ray.init(
        num_cpus=cpus,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.WARNING,
        object_store_memory=128 * 1024 * 1024,
        _temp_dir=temp_dir,
    )
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def measure_ray(options: PeerOptions, progress: Callable[[str], None]) -> tuple[str, _Timed, _Timed]:
    """(Ray's version, 1-CPU placement groups until ready, 1-CPU actors until they answer)."""
    ray, pgs = _import_ray()

    class Probe:  # defined here so Ray ships it by value, whatever the workers can import
        def ready(self) -> bool:
            return True

    def placement_group() -> None:
        group = pgs.placement_group([{"CPU": 1}])
        try:
            ray.get(group.ready(), timeout=options.timeout)
        finally:
            pgs.remove_placement_group(group)

    progress(f"starting Ray {ray.__version__} with {options.ray_cpus} CPUs")
    with _local_ray(ray, options.ray_cpus):
        probe = ray.remote(num_cpus=1)(Probe)

        def actor() -> None:
            handle = probe.remote()
            try:
                ray.get(handle.ready.remote(), timeout=options.timeout)
            finally:
                ray.kill(handle)

        progress(f"{options.count} Ray placement groups (1 CPU), one at a time")
        groups = _timed(placement_group, warmup=options.warmup, count=options.count)
        progress(f"{options.count} Ray actors (1 CPU), one at a time")
        actors = _timed(actor, warmup=options.warmup, count=options.count)
    return str(ray.__version__), groups, actors


def measure_fauxmad(options: PeerOptions, progress: Callable[[str], None]) -> tuple[CreateRun, CreateRun]:
    """(creates that reserve, creates that start a process), on a fleet of our own, at concurrency 1."""
    fleet = PlacementOptions(workers=options.workers, concurrency=1, count=options.count, warmup=options.warmup)
    with fleet_url(fleet, progress) as url, asyncio.Runner(loop_factory=uvloop.new_event_loop) as loop:
        runs = []
        for start in (False, True):
            what = "creates+starts" if start else "creates (reserve)"
            progress(f"{options.count} fauxmad {what}, one at a time")

            def creates(count: int, start: bool = start) -> CreateRun:
                return loop.run(
                    measure_creates(
                        url, fleet.region_names, count=count, concurrency=1, strategy=fleet.strategy, start=start
                    )
                )

            if options.warmup:
                creates(options.warmup)
            runs.append(creates(options.count))
    return runs[0], runs[1]


def run_peer(options: PeerOptions, progress: Callable[[str], None] = lambda line: None) -> PeerResult:
    if not ray_available():  # before anything starts
        raise PeerMissing(f"Ray is not installed: {INSTALL_HINT}")
    create, create_start = measure_fauxmad(options, progress)
    version, groups, actors = measure_ray(options, progress)
    fauxmad_create, fauxmad_start = summarize(create.samples), summarize(create_start.samples)
    ray_groups, ray_actors = summarize(groups.samples), summarize(actors.samples)
    errors = {
        "fauxmad_create": create.errors + create.refused,
        "fauxmad_create_start": create_start.errors + create_start.refused,
        "ray_placement_group": groups.errors,
        "ray_actor": actors.errors,
    }
    firsts = [create.first_error, create_start.first_error, groups.first_error, actors.first_error]
    return PeerResult(
        count=options.count,
        concurrency=1,
        fauxmad_workers=options.workers,
        ray_version=version,
        ray_cpus=options.ray_cpus,
        fauxmad_create=fauxmad_create,
        fauxmad_create_start=fauxmad_start,
        ray_placement_group=ray_groups,
        ray_actor=ray_actors,
        create_over_placement_group=ratios(fauxmad_create, ray_groups),
        create_start_over_actor=ratios(fauxmad_start, ray_actors),
        errors=errors,
        host=host_info(),
        first_error=next((e for e in firsts if e), None),
    )


def report(result: PeerResult) -> Report:
    latencies = latency_table(
        f"fauxmad ({result.fauxmad_workers} workers) and Ray {result.ray_version} ({result.ray_cpus} CPUs), "
        "concurrency 1",
        [
            ("fauxmad create (reserve)", result.fauxmad_create),
            ("Ray placement group (1 CPU)", result.ray_placement_group),
            ("fauxmad create+start", result.fauxmad_create_start),
            ("Ray actor (1 CPU)", result.ray_actor),
        ],
    )
    pairs = Table(
        title="fauxmad / Ray",
        columns=("pair", "p50", "p99"),
        align="lrr",
        rows=(
            (
                "create / placement group",
                times(result.create_over_placement_group.p50),
                times(result.create_over_placement_group.p99),
            ),
            (
                "create+start / actor",
                times(result.create_start_over_actor.p50),
                times(result.create_start_over_actor.p99),
            ),
        ),
    )
    failed = {k: v for k, v in result.errors.items() if v}
    notes = ["fauxmad / Ray below 1x: fauxmad answers sooner"]
    if failed:
        notes.append(f"errors: {failed}; first: {result.first_error}")
    return Report(tables=(latencies, pairs), notes=tuple(notes))
