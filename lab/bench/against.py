"""`fauxmad bench placement --against REV`: this tree beside another git revision, in one run.

A regression nobody compares is a regression nobody sees. REV (any git revision: a tag such as v0.1.0, a
commit, HEAD~3) is built once into a virtualenv of its own: a temporary `git worktree` of it is
pip-installed (not editable, so the worktree goes away after) into `<cache>/<sha>/venv`, and the venv is
kept, so a second run starts at once (the cache keeps the few most recently used). Then rounds alternate
between this tree's `fauxmad bench placement --json` (run from this tree's root, uncommitted changes
included) and REV's own, with only the options the first wave's code knew already, at c=1 and at the asked
concurrency; each run starts its own fleet. Each side's figure is the median of its rounds (their
spread is kept), and the ratios are this tree's over REV's.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from lab.bench import BenchError
from lab.bench.placement import PlacementOptions
from lab.bench.report import Report, Table, host_info, times
from lab.bench.stats import ratio

Progress = Callable[[str], None]

ROOT = Path(__file__).resolve().parent.parent.parent
CACHE_ENV = "FAUXMAD_BENCH_AGAINST_CACHE"
KEEP_BUILDS = 4  # venvs kept in the cache, the most recently used
RUN_TIMEOUT = 1800.0  # one side's run, seconds


class BadRevision(BenchError):
    """REV is not a commit of this repository: a usage error (exit 2)."""


def default_cache() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "fauxmad" / "bench-against")


class AgainstOptions(msgspec.Struct, frozen=True, kw_only=True):
    rev: str
    placement: PlacementOptions
    rounds: int = 4  # per concurrency and side; --count is split over them
    cache: str | None = None  # where built revisions are kept (default: default_cache())


class RunFigures(msgspec.Struct, kw_only=True):
    """What one `fauxmad bench placement --json` run reported."""

    p50_ms: float
    p99_ms: float
    throughput_per_s: float
    errors: int
    refused: int


class AgainstSide(msgspec.Struct, kw_only=True):
    """One side at one concurrency: the median of its rounds, and each round."""

    p50_ms: float
    p99_ms: float
    throughput_per_s: float
    runs: list[RunFigures]


class AgainstLevel(msgspec.Struct, kw_only=True):
    concurrency: int
    this: AgainstSide
    rev: AgainstSide
    p50_ratio: float | None  # this tree's / REV's
    p99_ratio: float | None
    throughput_ratio: float | None


class Compared(msgspec.Struct, kw_only=True):
    """What every `--against` result says of its two sides (placement's here, the jobs' in jobs_against)."""

    rev: str
    rev_commit: str
    this_commit: str  # HEAD of this tree, `+changes` when it has uncommitted changes
    rounds: int
    host: dict[str, object]


class AgainstResult(Compared, kw_only=True):
    workers_per_region: int
    strategy: str
    count_per_round: int
    levels: list[AgainstLevel]


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=False)


def resolve(rev: str) -> str:
    """The full commit id REV names; BadRevision when it names none."""
    if not rev.strip() or rev.startswith("-"):
        raise BadRevision(f"invalid --against {rev!r}: give a git revision (a tag, a commit, HEAD~1)")
    found = _git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    if found.returncode != 0:
        raise BadRevision(f"unknown git revision {rev!r} for --against: no such commit in {ROOT}")
    return found.stdout.strip()


def this_commit() -> str:
    head = _git("rev-parse", "HEAD").stdout.strip()
    changed = _git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    return f"{head}+changes" if changed else head


def _clean_env() -> dict[str, str]:
    """The environment for another tree's processes: nothing that would point Python back at this one."""
    env = dict(os.environ)
    for name in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
        env.pop(name, None)
    return env


def build(rev: str, sha: str, cache: Path, progress: Progress) -> Path:
    """The `fauxmad` command of REV, built into `<cache>/<sha>/venv` unless it is there already."""
    home = cache / sha
    fauxmad = home / "venv" / "bin" / "fauxmad"
    if (home / "built").exists() and fauxmad.exists():
        progress(f"{rev} ({sha[:10]}): using its build in {home}")
        (home / "built").touch()
        return fauxmad
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    work = Path(tempfile.mkdtemp(prefix="fauxmad-against-"))
    tree = work / "tree"
    try:
        progress(f"{rev} ({sha[:10]}): checking it out in a temporary worktree {tree}")
        added = _git("worktree", "add", "--detach", str(tree), sha)
        if added.returncode != 0:
            raise BenchError(f"git worktree add of {rev} failed: {_last(added.stderr)}")
        progress(f"{rev}: a virtualenv in {home / 'venv'}")
        _step([sys.executable, "-m", "venv", str(home / "venv")], f"making a virtualenv for {rev}")
        install, how = _installer(home / "venv" / "bin" / "python")
        progress(f"{rev}: {how} of its tree (a minute at most; kept for the next run)")
        _step([*install, str(tree)], f"{how} of {rev}")
        if not fauxmad.exists():
            raise BenchError(f"{rev} built, but has no fauxmad command")
        (home / "built").touch()
    except BaseException:
        shutil.rmtree(home, ignore_errors=True)
        raise
    finally:
        _git("worktree", "remove", "--force", str(tree))
        _git("worktree", "prune")
        shutil.rmtree(work, ignore_errors=True)
    _prune(cache, keep=home)
    return fauxmad


def _installer(python: Path) -> tuple[list[str], str]:
    """The command that installs a tree (its path goes last) into the virtualenv of `python`, and its name: uv's when
    uv is installed (what pip does, in a third of the time), else pip's."""
    uv = shutil.which("uv") or shutil.which("uv", path=str(Path(sys.executable).parent))
    if uv is not None:
        return [uv, "pip", "install", "--quiet", "--compile-bytecode", "--python", str(python)], "uv pip install"
    return [str(python), "-m", "pip", "install", "--quiet"], "pip install"


def _step(command: list[str], what: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True, env=_clean_env(), check=False)
    if done.returncode != 0:
        raise BenchError(f"{what} failed: {_last(done.stderr or done.stdout)}")


def _last(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no output"


def _prune(cache: Path, keep: Path) -> None:
    """Keep the KEEP_BUILDS most recently used builds (a venv is about 130 MB)."""
    builds = sorted((p for p in cache.iterdir() if (p / "built").exists()), key=lambda p: (p / "built").stat().st_mtime)
    for old in builds[:-KEEP_BUILDS]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)


def bench_args(p: PlacementOptions, concurrency: int, count: int, output: Path) -> list[str]:
    """`bench placement` options that the first wave's code (v0.1.0) already understood."""
    args = ["bench", "placement", "--json", "--output", str(output)]
    args += ["--workers", str(p.workers), "--regions", str(p.regions), "--strategy", p.strategy]
    args += ["--concurrency", str(concurrency), "--count", str(count), "--warmup", str(p.warmup)]
    args += ["--brokers", str(p.brokers), "--echo-count", str(p.echo_count)]
    if p.workers_per_process:
        args += ["--workers-per-process", str(p.workers_per_process)]
    return [*args, "--start"] if p.start else args


def run_json(command: list[str], cwd: Path, who: str) -> tuple[Any, str]:
    """One side's `fauxmad bench ... --json` run: (its decoded JSON, its stdout), or a BenchError with the last
    line it wrote (also `bench jobs --against`'s)."""
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, cwd=cwd, env=_clean_env(), timeout=RUN_TIMEOUT, check=False
        )
    except subprocess.TimeoutExpired:
        raise BenchError(f"{who}'s bench did not finish within {RUN_TIMEOUT:g}s") from None
    if done.returncode != 0:
        raise BenchError(f"{who}'s bench failed (exit {done.returncode}): {_last(done.stderr or done.stdout)}")
    try:
        return msgspec.json.decode(done.stdout), done.stdout
    except msgspec.DecodeError as exc:
        raise BenchError(f"{who}'s bench wrote no JSON ({exc}): {_last(done.stdout)}") from None


def run_once(command: list[str], cwd: Path, who: str) -> RunFigures:
    """One side's run; its JSON's figures, or a BenchError with the last line it wrote."""
    data, stdout = run_json(command, cwd, who)
    try:
        return RunFigures(
            p50_ms=float(data["create"]["p50_ms"]),
            p99_ms=float(data["create"]["p99_ms"]),
            throughput_per_s=float(data["throughput_per_s"]),
            errors=int(data["errors"]),
            refused=int(data["refused"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise BenchError(f"{who}'s bench wrote no placement result ({exc}): {_last(stdout)}") from None


def side(runs: list[RunFigures]) -> AgainstSide:
    return AgainstSide(
        p50_ms=round(statistics.median(r.p50_ms for r in runs), 3),
        p99_ms=round(statistics.median(r.p99_ms for r in runs), 3),
        throughput_per_s=round(statistics.median(r.throughput_per_s for r in runs), 1),
        runs=runs,
    )


def level(concurrency: int, ours: list[RunFigures], theirs: list[RunFigures]) -> AgainstLevel:
    a, b = side(ours), side(theirs)
    return AgainstLevel(
        concurrency=concurrency,
        this=a,
        rev=b,
        p50_ratio=ratio(a.p50_ms, b.p50_ms),
        p99_ratio=ratio(a.p99_ms, b.p99_ms),
        throughput_ratio=ratio(a.throughput_per_s, b.throughput_per_s),
    )


def run_against(options: AgainstOptions, progress: Progress = lambda line: None) -> AgainstResult:
    p = options.placement
    if p.nats is not None or p.supercluster:
        raise BadRevision("--against starts fleets of its own on one server: leave out --nats and --supercluster")
    sha = resolve(options.rev)
    cache = Path(options.cache) if options.cache else default_cache()
    theirs_cmd = [str(build(options.rev, sha, cache, progress))]
    ours_cmd = [sys.executable, "-m", "orchestrator.cli"]
    per_round = max(1, p.count // options.rounds)
    levels = []
    with tempfile.TemporaryDirectory(prefix="fauxmad-against-") as tmp:
        output = Path(tmp) / "result.json"
        for concurrency in dict.fromkeys([1, p.concurrency]):
            ours: list[RunFigures] = []
            rev: list[RunFigures] = []
            for n in range(options.rounds):
                sides = [("this tree", ours_cmd, ROOT, ours), (options.rev, theirs_cmd, Path(tmp), rev)]
                for who, command, cwd, into in sides if n % 2 == 0 else sides[::-1]:
                    progress(f"c={concurrency}, round {n + 1} of {options.rounds}: {who}, {per_round} creates")
                    began = time.monotonic()
                    into.append(run_once([*command, *bench_args(p, concurrency, per_round, output)], cwd, who))
                    progress(f"  p50 {into[-1].p50_ms:.2f} ms ({time.monotonic() - began:.0f} s with its fleet)")
            levels.append(level(concurrency, ours, rev))
    return AgainstResult(
        rev=options.rev,
        rev_commit=sha,
        this_commit=this_commit(),
        workers_per_region=p.workers,
        strategy=p.strategy,
        count_per_round=per_round,
        rounds=options.rounds,
        levels=levels,
        host=host_info(),
    )


def report(result: AgainstResult) -> Report:
    columns = ("what", "rounds", "p50 ms", "p99 ms", "creates/s", "p50 of rounds")
    rows: list[tuple[str, ...]] = []
    notes: list[str] = []
    for lv in result.levels:
        for name, s in (("this tree", lv.this), (result.rev, lv.rev)):
            spread = ", ".join(f"{r.p50_ms:.2f}" for r in s.runs)
            rows.append(
                (
                    f"c={lv.concurrency} {name}",
                    str(len(s.runs)),
                    f"{s.p50_ms:.2f}",
                    f"{s.p99_ms:.2f}",
                    f"{s.throughput_per_s:.0f}",
                    spread,
                )
            )
            bad = sum(r.errors + r.refused for r in s.runs)
            if bad:
                notes.append(f"c={lv.concurrency} {name}: {bad} creates failed or were refused")
        notes.append(
            f"c={lv.concurrency}: this tree / {result.rev}: p50 {times(lv.p50_ratio)}, p99 {times(lv.p99_ratio)},"
            f" throughput {times(lv.throughput_ratio)}"
        )
    notes.append(
        f"this tree {result.this_commit[:12]}{'+changes' if result.this_commit.endswith('+changes') else ''},"
        f" {result.rev} {result.rev_commit[:12]}; each figure the median of its rounds"
    )
    title = (
        f"create against {result.rev}: {result.strategy}, {result.workers_per_region} workers, rounds of"
        f" {result.count_per_round} creates alternating (each run its own fleet)"
    )
    return Report(tables=(Table(title=title, columns=columns, align="lrrrrl", rows=tuple(rows)),), notes=tuple(notes))
