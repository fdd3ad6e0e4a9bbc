"""The process driver: each machine is an OS process tree under its own shim, limited by cgroups.

Why it exists: it is the first `Driver` (see workers/driver/base.py). Machines must outlive the worker, so
the worker never is a workload's parent: it starts a shim (workers/driver/shim.py) in a new session, the
shim forks the workload and records its end in `<workdir>/exit.json`. Whoever holds the `TaskHandle`
— this worker or its successor after a crash — can watch the shim and read that file.

Key decisions:

- Shims come from this driver's launcher (workers/driver/fork_server.py, a fork server started on the first
  `start` that keeps children forked ahead), one awaited message away: the event loop runs on
  meanwhile. Only when there is no launcher (it cannot start, died, or its request would be too
  big) is `python -I -S shim.py` spawned directly, which costs ~20-30 ms of CPU. Either way the shim
  is the same code in its own session, and `start` returns the same `TaskHandle`. A `start`
  cancelled while the launcher was starting its shim ends that machine (`_end_orphan`), so nothing
  runs that no handle names. `close()` stops the launcher and releases the limits' pool of
  cgroups made ahead (see workers/driver/cgroup_pool.py); the machines keep running.
- Watching uses a pidfd (`os.pidfd_open` + `loop.add_reader`): it works for processes that are not
  our children (re-adopted after a restart), costs no thread and no polling, and is immune to pid
  reuse once opened — `start_ticks` is compared right after opening it. Shims spawned directly are
  our children, reaped with `waitid(P_PIDFD, ...)`, which can never reap an unrelated process that
  reused the pid; the launcher reaps the shims it forked.
- `exit.json` is the single source of truth for how the workload ended. When the shim itself died
  without writing it, one is written with the shim's own wait status if it never started the
  workload (by the driver for its own child; by the launcher, before reaping, for the launcher's —
  so the driver waits, briefly, for the launcher to reap such a shim before deciding), else the
  driver writes `lost`, so every later reader gets the same answer.
- Signals go to the workload's process group (its pgid is its pid, read from `child.pid`), never to
  the shim's: SIGKILL cannot be ignored and would take the shim, and the exit status, with it.
  Right after `start` the shim may not have forked yet; `signal` then waits (a few ms, bounded) for
  `child.pid` rather than losing the signal.
- A signal is only sent while `exit.json` does not exist: until then the shim holds the workload's
  pid (as a zombie at worst), so it cannot have been reused by an unrelated process. Once signalled, the
  workload is held by a pidfd (checked to be the shim's session's, or the sandbox's own), and the next
  signal only asks that pidfd whether the process still runs: a resume after a suspend skips the files.
- `start` returns as soon as the shim exists (a few ms): it does not wait for the workload's exec.
- `exec` runs a command beside the workload with its environment, working directory and limits
  (workers/driver/execute.py). What the driver reads of /proc is workers/driver/proc.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import signal as signals
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from bus.contract.machines import ExecReply
from workers.driver.base import ExitStatus, TaskHandle, TaskSpec, TaskState
from workers.driver.execute import CHILD_PID, run_beside, user_of
from workers.driver.fork_client import LauncherClient
from workers.driver.fork_server import Request, make_request, prepare_workdir
from workers.driver.limits import Limits
from workers.driver.proc import (
    alive,
    proc_stat,
    processes_of,
    read_pid,
    rss,
    same_process,
    session_members,
    stopped,
)
from workers.driver.sandbox import bwrap_argv, bwrap_path
from workers.driver.shim import temporary

log = logging.getLogger(__name__)

SHIM = str(Path(__file__).with_name("shim.py"))
DESTROY_TIMEOUT = 10.0
KILL_PATIENCE = 5.0  # seconds a force destroy waits for the shim after its workload's SIGKILL, before killing it
# How long `signal` waits for a just-started shim to write child.pid (~1 ms from the launcher, ~20 ms
# when spawned directly).
STARTUP_PATIENCE = 5.0
STARTUP_POLL = 0.005
# How long `wait` gives the launcher to reap a shim that ended without exit.json (it does so at once).
LAUNCHER_REAP_PATIENCE = 1.0
LAUNCHER_REAP_POLL = 0.001
# Only when the kernel has no pidfd_open (Linux < 5.3): how often to look whether the shim ended.
FALLBACK_POLL = 0.1


class _ExitRecord(msgspec.Struct, kw_only=True):
    """The exit.json document, written by the shim (or by the driver when the shim died)."""

    exit_code: int | None = None
    signal: int | None = None
    finished_at: float = 0.0
    lost: bool = False


_decode_record = msgspec.json.Decoder(_ExitRecord).decode
_encode_record = msgspec.json.Encoder().encode


# (exit_code, signal) of a process we reaped ourselves.
WaitStatus = tuple[int | None, int | None]


def _read_record(handle: TaskHandle) -> _ExitRecord | None:
    try:
        return _decode_record(handle.status_path.read_bytes())
    except (OSError, msgspec.DecodeError):
        return None


def _write_record(handle: TaskHandle, record: _ExitRecord) -> None:
    """Atomically, like the shim does, so readers never see half a file."""
    tmp = Path(temporary(str(handle.status_path)))
    with open(tmp, "wb") as f:
        f.write(_encode_record(record))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, handle.status_path)


def _decode_wait(result: os.waitid_result) -> WaitStatus:
    if result.si_code == os.CLD_EXITED:
        return result.si_status, None
    return None, result.si_status


def _shim_argv(
    exe: str,
    cmd: list[str],
    workdir: str,
    cgroups: list[str],
    rlimit: int | None,
    sandbox: bool = False,
    user: str = "",
) -> list[str]:
    """`exe -I -S shim.py ...`: isolated mode, no site: the shim must not depend on the environment."""
    argv = [exe, "-I", "-S", SHIM, "--workdir", workdir]
    if user:
        argv += ["--user", user]
    for cgroup in cgroups:
        argv += ["--cgroup", cgroup]
    if rlimit is not None:
        argv += ["--rlimit-as", str(rlimit)]
    if sandbox:
        argv += ["--sandbox", "bwrap"]
    return [*argv, "--", *cmd]


def _command(spec: TaskSpec, workdir: Path, cwd: Path) -> list[str]:
    """What the shim runs: the machine's command, inside bwrap for a sandboxed machine (workers/driver/sandbox.py)."""
    if spec.sandbox != "bwrap":
        return spec.cmd
    bwrap = bwrap_path()
    if bwrap is None:
        raise FileNotFoundError(f"machine {spec.machine_id}: guest.sandbox 'bwrap' but bwrap is not installed")
    binds = [(host, path) for host, path in spec.volumes]  # its volumes, read-write at their mount paths
    if spec.image_root is not None:  # the image is seen read-only; the machine writes to its own directory
        image = spec.image_root
        return bwrap_argv(
            bwrap,
            spec.cmd,
            hostname=spec.machine_id,
            writable=[str(workdir)],
            readonly=[image],
            cwd=str(cwd),
            binds=binds,
        )
    return bwrap_argv(
        bwrap, spec.cmd, hostname=spec.machine_id, writable=[str(workdir), str(cwd)], cwd=str(cwd), binds=binds
    )


def _make_home(spec: TaskSpec) -> None:
    """The directory a machine run as another user writes to, owned by that user; the machine's own
    directory (the shim's files, its logs) stays the worker's, and can be passed through but not listed."""
    assert spec.run_as is not None
    os.makedirs(spec.home, exist_ok=True)
    os.chmod(spec.workdir, 0o711)
    os.chown(spec.home, *spec.run_as)
    for host, _ in spec.volumes:  # its volumes' roots are its own too
        os.chown(host, *spec.run_as)


class ProcessDriver:
    """Runs each machine as a process tree under a shim; see the module docstring."""

    name = "process"

    def __init__(self, limits: Limits, python: str = sys.executable) -> None:
        self.limits = limits
        self.python = python
        # Shims this driver spawned, so the Popen objects never reap a pid that was reused.
        self._children: dict[int, subprocess.Popen[bytes]] = {}
        # One watch per task, shared by concurrent `wait` calls; dropped once it has finished.
        self._watches: dict[tuple[int, int], asyncio.Task[ExitStatus]] = {}
        self._launcher = LauncherClient(python, orphaned=self._end_orphan)
        # Shims a cancelled `start` had already launched, being ended (see `_end_orphan`).
        self._orphans: set[asyncio.Task[None]] = set()
        # Workloads signalled before, by their shim's key: (pid, a pidfd of it), see `_workload_pid`.
        self._workloads: dict[tuple[int, int], tuple[int, int]] = {}
        # The last run started (or re-adopted) in each machine directory: the next one there starts only once
        # it has ended, see `_after_previous_run`.
        self._runs: dict[str, TaskHandle] = {}

    def __repr__(self) -> str:
        return (
            f"ProcessDriver(limits={self.limits.describe()}, launcher={self._launcher!r}, "
            f"direct_children={len(self._children)})"
        )

    @property
    def launcher_pid(self) -> int | None:
        """The launcher's pid (the shims' parent), None while there is none."""
        return self._launcher.pid

    def close(self) -> None:
        """Stop the launcher, give back the cgroups pooled for future machines and remove the worker's
        cgroup base if no machine is left in it, when the worker shuts down. Machines keep running (their
        cgroups keep the base); a later `start` would spawn a shim directly."""
        self._launcher.close()
        self.limits.close()
        for key in list(self._workloads):
            self._forget_workload(key)

    # -- start ---------------------------------------------------------------------------------------

    async def start(self, spec: TaskSpec) -> TaskHandle:
        if not spec.cmd:
            raise ValueError(f"machine {spec.machine_id}: empty command")
        workdir = Path(spec.workdir).absolute()  # created (or cleared) by the launcher, else below
        await self._after_previous_run(str(workdir))
        cgroups = self.limits.prepare(spec.machine_id, spec.memory_mb, spec.cpus)
        rlimit = self.limits.rlimit_as(spec.memory_mb)
        try:
            pid, ticks = await self._start_shim(spec, workdir, cgroups, rlimit)
        except BaseException:
            self.limits.cleanup(cgroups)
            raise
        handle = TaskHandle(pid=pid, start_ticks=ticks, workdir=str(workdir), cgroups=cgroups, started_at=time.time())
        self._runs[handle.workdir] = handle
        return handle

    async def _after_previous_run(self, workdir: str) -> None:
        """Return once the run started before in `workdir` has ended. A machine's runs share its directory
        (`exit.json`, `child.pid`) and its cgroups, and a new run clears what the one before left there: a
        shim still ending (writing `exit.json`) as the next run starts would lose its record to that
        clearing, or land it over the new run's, which then reads as ended and takes no signal. The
        lifecycle waits for a stop before it starts again; this holds for every caller, a cancelled start's
        orphan (still being ended) included. A previous run that does not end within `KILL_PATIENCE` has
        nobody left who wants it: it is ended as a force destroy ends it."""
        previous = self._runs.pop(workdir, None)
        if previous is None or not alive(previous):
            return
        log.warning("shim %d of %s still running at the next start there: waiting for its end", previous.pid, workdir)
        try:
            await asyncio.wait_for(self.wait(previous), KILL_PATIENCE)  # `wait` is shielded: the watch goes on
        except TimeoutError:
            await self.destroy(previous, force=True)

    async def _start_shim(
        self, spec: TaskSpec, workdir: Path, cgroups: list[str], rlimit: int | None
    ) -> tuple[int, int]:
        """(pid, start_ticks) of a new shim: from the launcher (awaited: the event loop runs on while
        it answers), else spawned directly."""
        cwd = Path(spec.run_dir).absolute()
        cmd, sandboxed = _command(spec, workdir, cwd), spec.sandbox != "none"
        user = user_of(spec)
        if user:
            _make_home(spec)
        request = make_request(
            workdir=str(workdir),
            cwd=str(cwd),
            cmd=cmd,
            env=spec.env,
            cgroups=cgroups,
            rlimit_as=rlimit,
            sandbox=sandboxed,
            user=user,
        )
        launched = await self._launcher.launch(request)
        if launched is not None:
            return launched
        prepare_workdir(str(workdir))
        argv = _shim_argv(self.python, cmd, str(workdir), cgroups, rlimit, sandboxed, user)
        proc = self._spawn(argv, spec.env, workdir, cwd)
        stat = proc_stat(proc.pid)
        # Our own child cannot vanish before we reap it, so its stat is there (as a zombie at worst).
        self._children[proc.pid] = proc
        return proc.pid, stat.start_ticks if stat else 0

    def _end_orphan(self, request: Request, pid: int, ticks: int) -> None:
        """A `start` was cancelled after the launcher had started its shim: nobody will hold that
        handle, so end the machine (as `destroy` does) rather than leave it running unseen."""
        args = request.args
        handle = TaskHandle(pid=pid, start_ticks=ticks, workdir=args.workdir, cgroups=args.cgroups, started_at=0.0)
        self._runs[handle.workdir] = handle  # a start in its directory waits for its end
        task = asyncio.get_running_loop().create_task(self.destroy(handle, force=True))
        self._orphans.add(task)
        task.add_done_callback(self._orphans.discard)

    @staticmethod
    def _spawn(argv: list[str], env: dict[str, str], workdir: Path, cwd: Path) -> subprocess.Popen[bytes]:
        with open(workdir / "stdout.log", "ab") as out, open(workdir / "stderr.log", "ab") as err:
            return subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=env,
                cwd=cwd,  # the shim's cwd is the workload's; the shim's own files are under `workdir`
                start_new_session=True,
                close_fds=True,
            )

    # -- wait ----------------------------------------------------------------------------------------

    async def wait(self, handle: TaskHandle) -> ExitStatus:
        key = (handle.pid, handle.start_ticks)
        task = self._watches.get(key)
        if task is None or task.get_loop() is not asyncio.get_running_loop():
            task = asyncio.ensure_future(self._watch(handle))
            self._watches[key] = task

            def forget(done: asyncio.Task[ExitStatus]) -> None:
                if self._watches.get(key) is done:
                    del self._watches[key]
                self._forget_workload(key)

            task.add_done_callback(forget)
        # shield: a cancelled waiter must not cancel the watch the other waiters share.
        return await asyncio.shield(task)

    async def _watch(self, handle: TaskHandle) -> ExitStatus:
        shim_status = await self._shim_ended(handle)
        return self._exit_status(handle, shim_status)

    async def _shim_ended(self, handle: TaskHandle) -> WaitStatus | None:
        """Resolve when the shim has ended; its wait status if we reaped it, else None."""
        try:
            pidfd = os.pidfd_open(handle.pid)
        except ProcessLookupError:
            return None
        except OSError:  # no pidfd support in this kernel
            await self._poll_until_ended(handle)
            return None
        try:
            if not same_process(handle):
                return None  # the pid was reused: the shim ended long ago
            await self._readable(pidfd)
            status = self._reap(handle.pid, pidfd)
            if status is None:
                await self._launcher_reaped(handle)
            return status
        finally:
            os.close(pidfd)

    async def _launcher_reaped(self, handle: TaskHandle) -> None:
        """Return once a shim our launcher forked is reaped, unless it left exit.json: the launcher
        writes one for a shim that never started its workload before reaping it (bounded, and only
        while the ended shim is still our launcher's zombie)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LAUNCHER_REAP_PATIENCE
        while not handle.status_path.exists() and loop.time() < deadline:
            stat = proc_stat(handle.pid)
            launcher = self._launcher.pid
            if stat is None or stat.start_ticks != handle.start_ticks or launcher is None or stat.parent != launcher:
                return
            await asyncio.sleep(LAUNCHER_REAP_POLL)

    @staticmethod
    async def _readable(fd: int) -> None:
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()

        def on_ready() -> None:
            if not ready.done():
                ready.set_result(None)

        loop.add_reader(fd, on_ready)
        try:
            await ready
        finally:
            loop.remove_reader(fd)

    async def _poll_until_ended(self, handle: TaskHandle) -> None:
        while alive(handle):
            await asyncio.sleep(FALLBACK_POLL)

    def _reap(self, pid: int, pidfd: int) -> WaitStatus | None:
        try:
            result = os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)
        except ChildProcessError:
            return None  # not our child: whoever adopted it reaps it
        if result is None:
            return None  # not waitable yet (cannot happen once the pidfd is readable; be safe)
        exit_code, sig = _decode_wait(result)
        proc = self._children.pop(pid, None)
        if proc is not None:  # tell Popen, or it would try to reap this pid again one day
            proc.returncode = exit_code if exit_code is not None else -(sig or 0)
        return exit_code, sig

    def _exit_status(self, handle: TaskHandle, shim_status: WaitStatus | None) -> ExitStatus:
        record = _read_record(handle)
        if record is None:
            record = self._record_for_dead_shim(handle, shim_status)
            with contextlib.suppress(OSError):
                _write_record(handle, record)
        return self._to_status(handle, record)

    def _to_status(self, handle: TaskHandle, record: _ExitRecord) -> ExitStatus:
        if record.lost:
            return ExitStatus(lost=True, finished_at=record.finished_at)
        oom = self.limits.oom_killed(handle.cgroups, record.signal)
        return ExitStatus(
            exit_code=record.exit_code, signal=record.signal, oom_killed=oom, finished_at=record.finished_at
        )

    @staticmethod
    def _record_for_dead_shim(handle: TaskHandle, shim_status: WaitStatus | None) -> _ExitRecord:
        """The shim ended without writing exit.json (killed, or failed before starting anything)."""
        now = time.time()
        workload = read_pid(Path(handle.workdir) / CHILD_PID)
        if workload is None and shim_status is not None:
            # The workload never started: the shim's own end is the task's end.
            return _ExitRecord(exit_code=shim_status[0], signal=shim_status[1], finished_at=now)
        if workload is not None:
            # The shim died under a running workload that nobody can watch any more. Kill it, so that
            # what we report (it ended) is true; the session check guards against a reused pid.
            stat = proc_stat(workload)
            if stat is not None and stat.in_session_of(handle, workload):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(workload, signals.SIGKILL)
        return _ExitRecord(lost=True, finished_at=now)

    # -- stop, signal, destroy ---------------------------------------------------------------------

    async def stop(self, handle: TaskHandle, timeout: float, signal: int) -> ExitStatus:
        if not alive(handle):
            return await self.wait(handle)
        await self.signal(handle, signal)
        try:
            return await asyncio.wait_for(self.wait(handle), timeout)
        except TimeoutError:
            await self.signal(handle, signals.SIGKILL)
            return await self.wait(handle)

    async def signal(self, handle: TaskHandle, signal: int) -> None:
        workload = await self._workload_pid(handle)
        if workload is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(workload, signal)

    async def _workload_pid(self, handle: TaskHandle) -> int | None:
        """The workload's pid (= its process group) while it may be signalled, else None.

        Once found (from `child.pid`, while `exit.json` is not there), the workload is held by a pidfd: while
        that is not readable the process has not even become a zombie, so its pid, and the group, are still
        its own. The next signal (a resume after a suspend, on the path of a held request) then costs one
        poll instead of a stat and a read (a quarter of a millisecond on a core gone idle)."""
        key = (handle.pid, handle.start_ticks)
        held = self._workloads.get(key)
        if held is not None:
            workload, pidfd = held
            if not _ended(pidfd):
                return workload
            self._forget_workload(key)  # it ended: exit.json decides, as below
        found = await self._workload_pid_from_files(handle)
        if found is not None:
            self._hold_workload(key, handle, found)
        return found

    def _hold_workload(self, key: tuple[int, int], handle: TaskHandle, workload: int) -> None:
        """Hold the workload by a pidfd once the process behind it is known to be this task's: in the shim's
        session (a sandbox is a session of its own, named by its pid) and started after the shim. A sandbox's
        pid is reaped by bwrap, not the shim, so `exit.json` being absent does not prove it by itself."""
        if key in self._workloads:
            return
        try:
            pidfd = os.pidfd_open(workload)
        except OSError:  # gone already, or no pidfd in this kernel: the files are read each time
            return
        stat = proc_stat(workload)
        ours = stat is not None and stat.in_session_of(handle, workload) and stat.start_ticks >= handle.start_ticks
        if not ours or _ended(pidfd) or handle.status_path.exists():
            os.close(pidfd)
            return
        self._workloads[key] = (workload, pidfd)

    def _forget_workload(self, key: tuple[int, int]) -> None:
        held = self._workloads.pop(key, None)
        if held is not None:
            os.close(held[1])

    async def _workload_pid_from_files(self, handle: TaskHandle) -> int | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STARTUP_PATIENCE
        while not handle.status_path.exists():
            workload = read_pid(Path(handle.workdir) / CHILD_PID)
            if workload is not None:
                return workload
            if not alive(handle) or loop.time() >= deadline:
                return None
            await asyncio.sleep(STARTUP_POLL)  # the shim is starting: child.pid is milliseconds away
        return None

    async def destroy(self, handle: TaskHandle, force: bool) -> None:
        if force:
            await self.signal(handle, signals.SIGKILL)
            try:
                await asyncio.wait_for(self.wait(handle), KILL_PATIENCE)  # `wait` is shielded: the watch goes on
            except TimeoutError:
                await self._kill_shim(handle)
        else:
            await self.stop(handle, DESTROY_TIMEOUT, signals.SIGTERM)
        if self._runs.get(handle.workdir) == handle:
            del self._runs[handle.workdir]
        await asyncio.to_thread(self.limits.cleanup, handle.cgroups)

    async def _kill_shim(self, handle: TaskHandle) -> None:
        """The workload's SIGKILL did not end the shim (no workload was known to signal, or it outlived the
        signal): kill the shim's session, the workload in it (a sandbox's too); `cleanup` then kills what is
        left in the machine's cgroups. A destroy must never wait forever: it holds the machine's lock, and every
        later verb of the machine, and the worker's own stop, would wait behind it."""
        log.warning("shim %d alive %gs after its workload's SIGKILL: killing its session", handle.pid, KILL_PATIENCE)
        if same_process(handle):  # its session id is its pid, and names no one else while it lives
            for pid in session_members(handle.pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signals.SIGKILL)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wait(handle), KILL_PATIENCE)

    # -- exec ----------------------------------------------------------------------------------------

    async def exec(self, handle: TaskHandle, spec: TaskSpec, cmd: list[str], timeout: float) -> ExecReply:
        """Run `cmd` in the machine's environment, working directory and limits (`workers.driver.execute`)."""
        rlimit = self.limits.rlimit_as(spec.memory_mb) or 0
        return await run_beside(handle, spec, cmd, timeout, python=self.python, rlimit=rlimit)

    # -- inspect, recover ----------------------------------------------------------------------------

    def inspect(self, handle: TaskHandle) -> TaskState:
        running = alive(handle)
        workload = read_pid(Path(handle.workdir) / CHILD_PID)
        if running:
            rss_bytes = rss(workload) if workload is not None else None
            is_stopped = workload is not None and stopped(workload)
            return TaskState(running=True, pid=handle.pid, child_pid=workload, rss_bytes=rss_bytes, stopped=is_stopped)
        # Ended but not yet waited for: a missing exit.json reads as lost here (`wait` may know better
        # if the shim was our child and never started the workload).
        record = _read_record(handle) or _ExitRecord(lost=True)
        exit_status = self._to_status(handle, record)
        return TaskState(running=False, pid=handle.pid, child_pid=workload, exit=exit_status)

    def recover(self, handle: TaskHandle) -> bool:
        running = alive(handle)
        if running:
            self._runs[handle.workdir] = handle  # re-adopted: the next start in its directory waits for its end
        return running

    async def end_strays(self, machine_id: str, patience: float = 5.0) -> int:
        """Kill whatever runs of `machine_id` although no handle names it, and wait until it is gone; returns
        how many processes there were. A worker killed between spawning a machine's shim and recording its
        handle leaves such a run behind, and must not start a second one beside it on its next start.

        Found by the machine id in the workload's environment (the shim of a launcher carries the launcher's
        own), with its shim: the leader of the workload's session, which the workload runs in."""
        strays = processes_of(machine_id)
        shims = {stat.session for stat in filter(None, map(proc_stat, strays)) if stat.session > 1}
        shims.discard(os.getpid())
        everyone = set(strays) | shims
        for pid in everyone:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signals.SIGKILL)
        deadline = time.perf_counter() + patience
        while time.perf_counter() < deadline:
            alive = [pid for pid in everyone if (stat := proc_stat(pid)) is not None and stat.state not in ("Z", "X")]
            if not alive:
                break
            await asyncio.sleep(0.01)
        return len(strays)

    # -- helpers -------------------------------------------------------------------------------------


def _ended(pidfd: int) -> bool:
    """Whether the process behind a pidfd has exited (its pidfd is readable then), without waiting."""
    poller = select.poll()  # not select.select: a worker with many machines has fds past FD_SETSIZE
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))
