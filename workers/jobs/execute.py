"""How one attempt of a job runs: as a machine (the default) or as a plain child process (the fast path).

`MachineExecutor` reserves and launches a machine on this worker's own manager, in-process: the pull
already bound the job to this worker, so there is no auction and no bus leg. The machine has restart
policy `no` (retries are the queue's, and may land on another worker) and `auto_destroy`, so it destroys
itself when done, even if the worker is gone by then; its command runs under `timeout -s KILL`, so an
attempt orphaned by a dead worker ends by its deadline (the fence a redelivery waits for).

`ProcessExecutor` is the fast path: the command is the worker's child (`posix_spawn`, see `spawn`) in a
session of its own, listed with the worker's reaper (`reaper`), so it dies with its worker; no machine
record, no shim, no LMDB commit. It runs in the worker's working directory.
Either way the outcome is the exit status and the last `OUTPUT_KEEP` characters of stdout and stderr.

A job with an image (a digest, pinned at submit) runs in it, from the worker's image cache
(`workers.image_cache`, the one its machines use: pulled once, checked against the digest, unpacked once). The
image is made ready before anything else, so an image that cannot be had (damaged in the store, gone) is a
failed attempt saying why, and leaves no machine behind. A machine attempt runs in the image as any
machine of that image does (its directory, its manifest's env, `$HOME` its own); a process attempt runs in
the image's working directory (through `env -C`: `posix_spawn` cannot change directory) with the
manifest's env under the job's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import msgspec

from bus.contract.errors import FauxmadError
from bus.contract.jobs import OUTPUT_KEEP, Job
from bus.contract.machines import JOB_LABEL, DestroyRequest, Guest, MachineConfig, ReserveRequest, RestartPolicy
from bus.stores.images import ImageError
from workers.image_cache import ImageCache, Pulled
from workers.jobs.reaper import Reaper
from workers.jobs.spawn import Cancel, spawn
from workers.lifecycle.manager import MachineManager

Started = Callable[[str | None], None]  # told when the attempt's process runs (with its machine id)


class Outcome(msgspec.Struct, kw_only=True):
    exit_code: int | None = None
    signal: int | None = None
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    cancelled: bool = False
    no_room: bool = False  # it could not start here (the worker filled up): not an attempt
    error: str = ""  # it could not start at all (a failed attempt)
    machine_id: str | None = None
    started_at: float | None = None  # set by the runner: when the process ran

    @property
    def success(self) -> bool:
        return self.exit_code == 0 and not (self.timed_out or self.cancelled or self.error)


class Executor(Protocol):
    async def run(self, job: Job, attempt: int, cancel: Cancel, started: Started) -> Outcome: ...


async def ready_image(images: ImageCache | None, job: Job) -> Pulled | str | None:
    """The job's image on this host (None: it has none), or why it cannot be had (a failed attempt)."""
    if job.image is None:
        return None
    if images is None:
        return f"image {job.image}: this worker keeps no images"
    try:
        return await images.ensure(job.image)
    except ImageError as exc:
        return f"image {job.image}: {exc}"
    except Exception as exc:  # the store unreachable, a full disk: this attempt fails, a retry may not
        return f"image {job.image} could not be pulled: {exc!r}"


def tail_text(data: bytes, keep: int = OUTPUT_KEEP) -> str:
    return data[-keep * 4 :].decode("utf-8", "replace")[-keep:]


def read_tail(path: Path, keep: int = OUTPUT_KEEP) -> str:
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - keep * 4))
            return tail_text(f.read(), keep)
    except OSError:
        return ""


async def _until(task: asyncio.Future[Any], cancel: Cancel, timeout: float) -> str:
    """`done`, `cancelled` or `timeout`: whichever comes first."""
    cancelled = asyncio.ensure_future(cancel.wait())
    try:
        done, _ = await asyncio.wait({task, cancelled}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        cancelled.cancel()
    if task in done:
        return "done"
    return "cancelled" if cancel.is_set() else "timeout"


class MachineExecutor:
    def __init__(self, manager: MachineManager, region: str) -> None:
        self.manager = manager
        self.region = region
        self.killer = shutil.which("timeout")

    def config(self, job: Job, attempt: int) -> MachineConfig:
        cmd = list(job.cmd)
        if self.killer:
            cmd = [self.killer, "-s", "KILL", f"{job.timeout + 0.5:g}", *cmd]
        return MachineConfig(
            image=job.image,
            cmd=cmd,
            env={**job.env, "FAUXMAD_JOB_ID": job.id, "FAUXMAD_JOB_ATTEMPT": str(attempt)},
            guest=Guest(cpus=job.cpus, memory_mb=job.memory_mb),
            restart=RestartPolicy(policy="no"),
            auto_destroy=True,
            metadata={JOB_LABEL: job.id, "fauxmad_attempt": str(attempt)},
        )

    async def run(self, job: Job, attempt: int, cancel: Cancel, started: Started) -> Outcome:
        manager = self.manager
        image = await ready_image(manager.images, job)
        if isinstance(image, str):
            return Outcome(error=image)
        request = ReserveRequest(app=job.app, region=self.region, config=self.config(job, attempt), launch=True)
        try:
            machine = await manager.reserve(request)
        except FauxmadError as exc:
            return Outcome(no_room=exc.code == 503, error=exc.message)
        started(machine.id)
        ended = asyncio.ensure_future(manager.wait_for(machine.id, {"stopped", "failed", "destroyed"}, job.timeout + 5))
        how = await _until(ended, cancel, job.timeout)
        if how != "done":
            with contextlib.suppress(FauxmadError):
                await manager.destroy(DestroyRequest(id=machine.id, force=True), source="worker")
            with contextlib.suppress(BaseException):
                await ended
        elif ended.exception() is not None:
            with contextlib.suppress(BaseException):
                ended.result()
        final = manager.store.get(machine.id)
        info = final.machine.exit if final is not None else None
        workdir = manager.workdir(machine.id)
        return Outcome(
            exit_code=info.exit_code if info else None,
            signal=info.signal if info else None,
            stdout=read_tail(workdir / "stdout.log"),
            stderr=read_tail(workdir / "stderr.log"),
            timed_out=how == "timeout",
            cancelled=how == "cancelled",
            machine_id=machine.id,
            error="" if info is not None or how != "done" else "the machine ended without an exit status",
        )


class ProcessExecutor:
    """The fast path: see the module docstring."""

    def __init__(self, base_env: dict[str, str], reaper: Reaper, images: ImageCache | None = None) -> None:
        self.base_env = base_env
        self.reaper = reaper
        self.images = images
        self.chdir = shutil.which("env")  # coreutils' `env -C DIR CMD...`: an image job's working directory

    async def run(self, job: Job, attempt: int, cancel: Cancel, started: Started) -> Outcome:
        image = await ready_image(self.images, job)
        if isinstance(image, str):
            return Outcome(error=image)
        defaults = image.manifest.env if image is not None and image.manifest is not None else {}
        env = {
            **self.base_env,
            **defaults,
            **job.env,
            "FAUXMAD_JOB_ID": job.id,
            "FAUXMAD_JOB_ATTEMPT": str(attempt),
        }
        argv = list(job.cmd)
        if image is not None:
            if self.chdir is None:
                return Outcome(error="a process job in an image needs `env` (coreutils) on the worker's PATH")
            argv = [self.chdir, "-C", str(image.workdir), *argv]
        try:
            ended = await spawn(argv, env, job.timeout, cancel, self.reaper, lambda: started(None))
        except OSError as exc:
            return Outcome(exit_code=127, error=f"cannot run {job.cmd[0]!r}: {exc.strerror or exc}")
        return Outcome(
            exit_code=ended.exit_code,
            signal=ended.signal,
            stdout=tail_text(ended.stdout),
            stderr=tail_text(ended.stderr),
            timed_out=ended.how == "timeout",
            cancelled=ended.how == "cancelled",
        )


def base_env() -> dict[str, str]:
    return {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "TZ") if k in os.environ}
