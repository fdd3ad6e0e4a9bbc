"""The launch spec: what a machine's process runs with on this host (command, environment, directory, limits,
image, volumes, user).

A verb decides *that* a machine starts; this module decides *what* starts. The same spec serves the process,
its health checks and `exec`, so they all see one environment. Before a launch, `prepare` makes the host
ready for it (its image pulled and unpacked, its volumes mounted, again after a host reboot).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from bus.contract.errors import BadRequest
from bus.contract.machines import Machine, MachineConfig
from bus.stores.images import is_digest
from workers.driver.base import TaskSpec
from workers.image_cache import ImageCache, Pulled
from workers.lifecycle.config import ManagerConfig
from workers.log.records import StoredMachine
from workers.volumes.verbs import VolumeManager

INHERITED_ENV = ("PATH", "HOME", "LANG", "TZ")  # of the worker's own environment, the names a machine gets


class LaunchSpecs:
    def __init__(
        self,
        config: ManagerConfig,
        *,
        images: ImageCache | None,
        volumes: VolumeManager | None,
        secret_env: Callable[[str], dict[str, str]],
    ) -> None:
        self.config = config
        self.images = images  # machines whose config.image is a digest run in their unpacked image
        self.volumes = volumes  # machines with config.mounts run with those volumes
        self.secret_env = secret_env  # the app's secrets in clear, for the environment only (workers/secrets.py)

    def workdir(self, machine_id: str) -> Path:
        return Path(self.config.data_dir) / "machines" / machine_id

    async def prepare(self, machine: Machine) -> Pulled | None:
        """Make this host ready to run the machine: its image (pulled and unpacked first if needed, when it
        names one by digest; returned) and its volumes, mounted before it runs."""
        pulled = None
        image = machine.config.image
        if self.images is not None and image is not None and is_digest(image):
            pulled = await self.images.ensure(image)
        for mount in machine.config.mounts:
            if self.volumes is None:
                raise RuntimeError("this worker has no volumes")
            await self.volumes.ready(mount.volume)
        return pulled

    def task_spec(self, stored: StoredMachine) -> TaskSpec:
        """What the driver runs for this machine; checks and `exec` run in the same environment."""
        machine = stored.machine
        env = {key: os.environ[key] for key in INHERITED_ENV if key in os.environ}
        digest = machine.config.image
        image = self.images.ready(digest) if self.images is not None and digest and is_digest(digest) else None
        sandbox = machine.config.guest.sandbox
        # a machine runs as the worker's --machine-user, but in a sandbox, whose mounts already hide the worker's files
        run_as = self.config.run_as if sandbox == "none" else None
        home = str(self.workdir(machine.id)) if run_as is None else str(self.workdir(machine.id) / "home")
        if image is not None or run_as is not None:  # it writes to its own directory
            env.update(image.manifest.env if image is not None and image.manifest else {})
            env.update({"HOME": home, "TMPDIR": home})
        env.update(machine.config.env)
        env.update(self.secret_env(machine.app))
        env.update(
            {
                "PORT": str(machine.port),
                "FAUXMAD_MACHINE_ID": machine.id,
                "FAUXMAD_APP": machine.app,
                "FAUXMAD_REGION": machine.region,
                "FAUXMAD_WORKER_ID": machine.worker_id,
                "FAUXMAD_INSTANCE_ID": machine.instance_id,
            }
        )
        volumes = volume_paths(self.volumes, machine)
        for index, (host, path) in enumerate(volumes):  # a sandbox has it at its path; else the host's directory
            seen = path if sandbox != "none" else host
            if index == 0:
                env["FAUXMAD_VOLUME_PATH"] = seen
            env[f"FAUXMAD_VOLUME_{index}"] = seen
        return TaskSpec(
            machine_id=machine.id,
            cmd=list(machine.config.cmd),
            env=env,
            workdir=str(self.workdir(machine.id)),
            memory_mb=machine.config.guest.memory_mb,
            cpus=machine.config.guest.cpus,
            cwd=str(image.workdir) if image is not None else machine.config.workdir,
            sandbox=sandbox,
            image_root=str(image.root) if image is not None else None,
            run_as=run_as,
            volumes=volumes,
        )


def check_workdir(config: MachineConfig, worker_id: str) -> None:
    """`config.workdir` must be a directory on this host (until images ship an app's files)."""
    if config.workdir is not None and not Path(config.workdir).is_dir():
        raise BadRequest(f"config.workdir: {config.workdir} is not a directory on worker {worker_id}")


def volume_paths(volumes: VolumeManager | None, machine: Machine) -> list[tuple[str, str]]:
    """(host directory, mount path) of each of the machine's volumes."""
    if volumes is None:
        return []
    return [(str(volumes.host_path(m.volume)), m.path) for m in machine.config.mounts]
