"""A mount namespace copied while a volume is mounted does not keep the volume after the worker unmounts it.

`ip netns exec` (a host of `fauxmad dev --hosts`) and bubblewrap (a sandboxed machine) copy every mount of the
moment into a namespace of their own and make the copies slaves. Where the host's root mount is private (containers;
this project's CI), a copy of a volume's loop mount kept its filesystem and loop device alive after the worker's
unmount: CI saw an offline grow mount the old 1 GB filesystem again. The worker's volumes directory is a shared
mount of its own (`workers.volumes.storage`), so its unmounts reach such copies. `unshare --propagation slave` makes
the same copy those tools make. On a host whose root mount is shared the copy follows either way. (Removing a
volume deletes its mount point, which ends every copy's mount whatever the propagation: the grow is what was hit.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from orchestrator.devfleet import unmount_under
from tests.helpers import wait_until
from workers.volumes.storage import VolumeFs

pytestmark = pytest.mark.fleet  # starts processes of its own (a namespace's copier), mounts as root


def _mounted_in(pid: int, path: Path) -> bool:
    """Whether process `pid`'s mount namespace has a mount at `path`."""
    points = [line.split()[4] for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()]
    return str(path) in points


def test_a_namespace_copied_while_a_volume_is_mounted_does_not_keep_it(tmp_path: Path) -> None:
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    fs = VolumeFs(tmp_path / "volumes")
    if fs.detect() != "loop":
        pytest.skip("this host cannot loop-mount an ext4 image (root, mkfs.ext4 and loop devices are needed)")
    copier: subprocess.Popen[bytes] | None = None
    try:
        fs.make("vol1", 1, "loop")
        copier = subprocess.Popen(["unshare", "--mount", "--propagation", "slave", "sleep", "60"])
        ours = os.readlink("/proc/self/ns/mnt")
        wait_until(
            lambda: (
                os.readlink(f"/proc/{copier.pid}/ns/mnt") != ours
                and "sleep" in Path(f"/proc/{copier.pid}/comm").read_text()
            ),
            "the copier in a mount namespace of its own",
        )
        volume = fs.path("vol1")
        assert _mounted_in(copier.pid, volume)
        # the grow: online where the kernel lets this process (CAP_SYS_RESOURCE), else unmounted, grown, mounted again
        assert fs.ensure("vol1", 2, "loop", offline_ok=True)
        subprocess.run(["umount", str(volume)], check=True)  # what the offline grow does first
        wait_until(lambda: not _mounted_in(copier.pid, volume), "the copy unmounted with the volume", timeout=5)
    finally:
        if copier is not None:
            copier.kill()
            copier.wait()
        unmount_under(tmp_path)
