"""Fixtures: a real nats-server (JetStream on) per session, and factories for real workers.

The session starts by compiling the project's modules: a host that sets `PYTHONDONTWRITEBYTECODE` (this
CI's does) otherwise has every worker and CLI process the tests start compile them again, a tenth of a
second or more each (test_first_hour.py: 62 s without, 53 s with).

Two layers. A test that starts real processes (a nats-server, workers, brokers, CLIs, proxies, machines)
is marked `fleet`: by the fixtures it uses, directly or through others (`PROCESS_FIXTURES`, and every fixture
made by `tests.helpers.fleet_fixture` or with `starts_processes` on its function), by its own
`@pytest.mark.fleet` (a test that starts processes in its body) or by its module's `pytestmark`; never by what
its source says. The rest is the fast layer (`just test-fast`: pure functions and single components with
injected clocks). Under pytest-xdist each xdist worker has its own nats-server (a session each) and its own
slice of the ports `bus.local.ports` hands out ($FAUXMAD_PORT_RANGE, inherited by every process it starts),
so two slices never race for one port.

A failing test keeps the logs of every fleet it ran or ran beside (`DevFleet`: each process's and each
nats-server's) under `<basetemp>/fleet-logs/<test>/<fleet>/`, and its report names that directory: a failure
of two files at a time can be read after the run (pytest keeps the last three basetemps). A fleet stopped
inside the test is copied as it stops (its directory goes with it); one still running when the test fails
(a module's fleet) is copied then, with its machines' output (the last 64 KiB of each one's stdout and stderr,
and its `exit.json`). A test that passes leaves nothing there.
"""

from __future__ import annotations

import compileall
import contextlib
import itertools
import os
import re
import shutil
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from bus.local.embedded import EmbeddedNats
from orchestrator import devfleet
from orchestrator.devfleet import DevFleet
from tests.helpers import WorkerProcess
from tests.scheduling import LongestFirst

_ids = itertools.count(1)
ROOT = Path(__file__).resolve().parent.parent


PROCESS_FIXTURES = frozenset(
    {"nats_server", "nats_url", "fresh_nats", "worker_factory", "fleet", "secure_fleet", "crashable_nats"}
)
PORTS_LOW, PORTS_HIGH = 10_000, 32_000  # below the kernel's ephemeral range (bus/local/ports.py)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fleet: starts real processes (nats-server, workers, CLIs); not in test-fast")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if worker.startswith("gw") and "FAUXMAD_PORT_RANGE" not in os.environ:
        span = (PORTS_HIGH - PORTS_LOW) // count
        low = PORTS_LOW + int(worker[2:]) * span
        os.environ["FAUXMAD_PORT_RANGE"] = f"{low}-{low + span - 1}"


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> LongestFirst | None:
    """`--dist loadfile`: the longest files first (`tests/scheduling.py`)."""
    return LongestFirst(config, log) if config.getvalue("dist") == "loadfile" else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("fleet") is not None:
            continue
        fixtures = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        if set(fixtures) & PROCESS_FIXTURES or any(
            getattr(d.func, "starts_processes", False) for defs in fixtures.values() for d in defs
        ):
            item.add_marker(pytest.mark.fleet)


def pytest_sessionstart(session: pytest.Session) -> None:
    for package in ("bus", "orchestrator", "workers", "tests"):
        compileall.compile_dir(ROOT / package, quiet=1, workers=0)
    devfleet.BEFORE_REMOVAL.append(_keep_logs_of)


# --- a failing test's fleets' logs ---------------------------------------------------------------------------
_current: list[pytest.Item] = []  # the test running now (fleets stopped between tests belong to none)
_failed = pytest.StashKey[bool]()


_kept = pytest.StashKey[Path]()


def _fleet_logs_dir(item: pytest.Item) -> Path:
    if _kept not in item.stash:
        base = item.config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
        item.stash[_kept] = Path(base) / "fleet-logs" / re.sub(r"[^\w.-]+", "_", item.nodeid)[-120:]
    return item.stash[_kept]


MACHINE_OUTPUTS = ("stdout.log", "stderr.log", "exit.json")
MACHINE_OUTPUT_MOST = 64 * 1024  # bytes of a machine's output kept (its last): enough to say why it did not serve


def _copy_logs(fleet: DevFleet, into: Path, *, machines: bool = False) -> None:
    """The fleet's logs; with `machines`, each machine's output too (a fleet still up when its test failed: a
    machine that never listened says why only there). Not for every fleet stopped in a test that may pass: a
    fleet of hundreds of machines would copy them all for nothing."""
    for relative in fleet.log_files():
        target = into / fleet.root.name / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(fleet.root / relative, target)
    for output in _machine_outputs(fleet.root) if machines else []:
        target = into / fleet.root.name / output.relative_to(fleet.root)
        target.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError), open(output, "rb") as source:  # (a machine destroyed meanwhile)
            source.seek(max(0, os.fstat(source.fileno()).st_size - MACHINE_OUTPUT_MOST))
            target.write_bytes(source.read(MACHINE_OUTPUT_MOST))  # (a machine still writing)


def _machine_outputs(root: Path) -> list[Path]:
    return [path for name in MACHINE_OUTPUTS for path in root.glob(f"workers/*/machines/*/{name}") if path.is_file()]


def _keep_logs_of(fleet: DevFleet) -> None:
    """`devfleet.BEFORE_REMOVAL`: a fleet stopping during a test leaves its logs with the test, until it passes."""
    if _current:
        _copy_logs(fleet, _fleet_logs_dir(_current[-1]))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    _current.append(item)
    try:
        yield
    finally:
        _current.remove(item)
        logs = item.stash.get(_kept, None)
        if logs is not None and not item.stash.get(_failed, False):
            shutil.rmtree(logs, ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, None, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not report.failed:
        return
    item.stash[_failed] = True
    logs = _fleet_logs_dir(item)
    for fleet in list(DevFleet.running):  # fleets still up: a module's, or the test's own before its stop
        _copy_logs(fleet, logs, machines=True)
    if logs.exists():
        report.sections.append(("fleet logs", f"the logs of this test's fleets: {logs}"))


@pytest.fixture(scope="session")
def nats_server() -> Iterator[EmbeddedNats]:
    with EmbeddedNats(name="fauxmad-tests") as server:
        yield server


@pytest.fixture
def nats_url(nats_server: EmbeddedNats) -> str:
    return nats_server.url


@pytest.fixture
def fresh_nats() -> Iterator[EmbeddedNats]:
    with EmbeddedNats(name="fauxmad-test-fresh") as server:
        yield server


@pytest.fixture
def unique() -> Callable[[str], str]:
    """Unique names per test, so tests can share one nats-server without seeing each other."""
    run = next(_ids)
    # xdist workers count from 1 each: their tag keeps names apart, or one's cleanup (kill_machines_of, by worker
    # id) kills the other's machines
    tag = os.environ.get("PYTEST_XDIST_WORKER", "").removeprefix("gw")

    def make(prefix: str) -> str:
        return f"{prefix}{run}x{next(_ids)}" + (f"g{tag}" if tag else "")

    return make


@pytest.fixture
def worker_factory(
    tmp_path: Path, nats_url: str, unique: Callable[[str], str]
) -> Iterator[Callable[..., WorkerProcess]]:
    started: list[WorkerProcess] = []

    def make(
        region: str | None = None,
        *,
        url: str | None = None,
        worker_id: str | None = None,
        cpus: int = 4,
        memory_mb: int = 4096,
        extra: list[str] | None = None,
    ) -> WorkerProcess:
        wid = worker_id or unique("w")
        worker = WorkerProcess(
            url or nats_url, region or unique("r"), wid, tmp_path / wid, cpus=cpus, memory_mb=memory_mb, extra=extra
        )
        started.append(worker)
        return worker.start()

    yield make
    for worker in started:
        worker.cleanup()
