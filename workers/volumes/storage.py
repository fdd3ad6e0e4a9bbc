"""Where a volume's bytes live on the worker's host, and how its size is enforced.

Two backends, detected once per worker process when its first volume is made (`detect`: probing costs a
mkfs and a mount, which a worker that never holds a volume should not pay), and kept with each volume
(`size_limit`), so a volume is always handled the way it was made:

- `loop` (the default wherever it works): each volume is a sparse file `<data>/volumes/<id>.img` of
  `size_gb` GiB holding an ext4 filesystem, loop-mounted at `<data>/volumes/<id>`. The kernel enforces
  the size (a write past it is ENOSPC), a sparse file costs only what is written, and extending is a
  `truncate` plus `resize2fs` (online; where the kernel refuses that, at the next start of the machine
  using it, or at once if none does). It needs root (mount, losetup) and `mkfs.ext4`; `detect`
  proves it works by making, mounting and unmounting a small image rather than guessing from the uid.
- `dir` (the fallback): a plain directory. The size is not enforced by the kernel (no loop devices,
  and a project quota would need the data dir's filesystem mounted with `prjquota`, which a worker
  cannot arrange for itself); a volume's usage is measured and reported, and the README says so.

The worker's `<data>/volumes` is a mount point of its own with shared propagation (a bind of it onto itself,
made before its first loop mount). A process that makes a mount namespace of its own copies every mount of the
moment: `ip netns exec` (a host of `fauxmad dev --hosts`), bubblewrap (a sandboxed machine), systemd's private
mounts. Where the host's root mount is private (containers; this project's CI), such a copy kept a volume's
filesystem alive after the worker unmounted it: its loop device stayed, and an offline grow mounted the old
filesystem again (CI: 1 GB after a grow to 2). Those tools make their copies slaves of the mounts they copy, so
under a shared mount the worker's unmounts reach them. (Removing a volume was never pinned: deleting its mount
point ends every copy's mount.)

Every call here is idempotent (`ensure` mounts only what is not mounted, resizes only what is smaller,
`remove` tolerates what is already gone), so the worker can redo any of them after a crash: the op log
says what the volume should be, this module makes the disk agree. Blocking: call through a thread.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

GIB = 1 << 30
TOOLS = ("mkfs.ext4", "mount", "umount", "losetup", "resize2fs", "e2fsck", "findmnt")


class VolumeFsError(Exception):
    """The host could not do what the volume needs (the message says which command and why)."""


def _run(*argv: str, ok: tuple[int, ...] = (0,)) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise VolumeFsError(f"{argv[0]}: {exc}") from None
    if done.returncode not in ok:
        raise VolumeFsError(f"{' '.join(argv[:2])}: {(done.stderr or done.stdout).strip()[:300]}")
    return done.stdout


@functools.lru_cache(maxsize=4)
def detect(scratch: str) -> str:
    """`loop` if this host can make, mount and unmount an ext4 image under `scratch`, else `dir`."""
    if os.geteuid() != 0 or any(shutil.which(tool) is None for tool in TOOLS):
        return "dir"
    Path(scratch).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch, prefix=".probe-") as tmp:
        image, mount = Path(tmp) / "probe.img", Path(tmp) / "mnt"
        mount.mkdir()
        try:
            with image.open("wb") as f:
                f.truncate(8 << 20)
            _run("mkfs.ext4", "-q", "-F", "-m", "0", str(image))
            _run("mount", "-o", "loop", str(image), str(mount))
        except VolumeFsError:
            return "dir"
        with contextlib.suppress(VolumeFsError):
            _run("umount", str(mount))
    return "loop"


class VolumeFs:
    """The volumes of one worker under `<data>/volumes`; each call names the volume's backend (`mode`)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._shared = False  # `root` made a shared mount point by this process (the module's docstring)

    def share(self) -> None:
        """Make `root` a mount point of its own with shared propagation, once a process (a restarted worker finds
        the bind there and shares it again). Without it volumes work, and may stay pinned (the module's
        docstring): one warning says so."""
        if self._shared:
            return
        self._shared = True
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            if not os.path.ismount(self.root):
                _run("mount", "--bind", str(self.root), str(self.root))
            _run("mount", "--make-shared", str(self.root))
        except VolumeFsError as exc:
            log.warning(
                "volumes under %s: not a shared mount (%s): a namespace copied meanwhile may pin them", self.root, exc
            )

    def detect(self) -> str:
        """The backend new volumes get on this host (probed on first use, then remembered)."""
        return detect(str(self.root))

    def path(self, volume_id: str) -> Path:
        """Where the volume's files are (the mount point of its image, or its directory)."""
        return self.root / volume_id

    def image(self, volume_id: str) -> Path:
        return self.root / f"{volume_id}.img"

    def mounted(self, volume_id: str) -> bool:
        return os.path.ismount(self.path(volume_id))

    def make(self, volume_id: str, size_gb: int, mode: str) -> None:
        """A new, empty volume (whatever a crash left of an earlier try is replaced)."""
        self.remove(volume_id)
        self.path(volume_id).mkdir(parents=True)
        if mode == "loop":
            self.share()
            with self.image(volume_id).open("wb") as f:
                f.truncate(size_gb * GIB)
            _run("mkfs.ext4", "-q", "-F", "-m", "0", "-E", "nodiscard", str(self.image(volume_id)))
            self.ensure(volume_id, size_gb, mode)
            with contextlib.suppress(OSError):
                os.rmdir(self.path(volume_id) / "lost+found")  # the volume starts empty, as users expect

    def ensure(self, volume_id: str, size_gb: int, mode: str, *, offline_ok: bool = True) -> bool:
        """Mounted, at its recorded size (after a restart, a crash mid-extend, a host reboot); True if the
        filesystem has that size now. Growing tries online first (`resize2fs` on the mounted device); where
        the kernel refuses that (some containers do), it unmounts, grows and mounts again, but only with
        `offline_ok` (nothing uses the volume): else the growth waits for the next start of its machine."""
        if mode != "loop":
            self.path(volume_id).mkdir(parents=True, exist_ok=True)
            return True
        image = self.image(volume_id)
        if not image.exists():
            raise VolumeFsError(f"volume {volume_id}: its image {image} is missing")
        if image.stat().st_size < size_gb * GIB:
            with image.open("r+b") as f:
                f.truncate(size_gb * GIB)
        self.path(volume_id).mkdir(parents=True, exist_ok=True)
        if not self.mounted(volume_id):
            self.share()
            _run("mount", "-o", "loop", str(image), str(self.path(volume_id)))
        if self._fs_bytes(volume_id, mode) >= size_gb * GIB * 0.9:  # ext4 keeps a few % for itself
            return True
        device = _run("findmnt", "-n", "-o", "SOURCE", "--mountpoint", str(self.path(volume_id))).strip()
        try:
            _run("losetup", "-c", device)  # the loop device learns the file's new size
            _run("resize2fs", device)  # online grow of a mounted ext4
        except VolumeFsError as exc:
            log.warning("volume %s: the online grow to %d GB was refused: %s", volume_id, size_gb, exc)
        # resize2fs can exit 0 having grown nothing ("already N blocks long", when the loop device has not
        # taken the file's new size): only the filesystem's own size says it grew
        if (now := self._fs_bytes(volume_id, mode)) >= size_gb * GIB * 0.9:
            return True
        log.warning("volume %s: %d bytes after the online grow to %d GB (%s)", volume_id, now, size_gb, device)
        if not offline_ok:
            return False
        _run("umount", str(self.path(volume_id)))
        _run("e2fsck", "-f", "-p", str(image), ok=(0, 1))  # 1: it fixed something
        _run("resize2fs", str(image))
        _run("mount", "-o", "loop", str(image), str(self.path(volume_id)))
        if (now := self._fs_bytes(volume_id, mode)) < size_gb * GIB * 0.9:
            log.warning("volume %s: %d bytes after the offline grow to %d GB", volume_id, now, size_gb)
            return False
        return True

    def _fs_bytes(self, volume_id: str, mode: str) -> int:
        block_size, blocks, _, _ = self.usage(volume_id, mode)
        return block_size * blocks

    def extend(self, volume_id: str, size_gb: int, mode: str, *, in_use: bool) -> bool:
        """Grow to `size_gb`; False if it must wait for the machine using it to start again."""
        return self.ensure(volume_id, size_gb, mode, offline_ok=not in_use)

    def remove(self, volume_id: str) -> None:
        """Unmount and delete the volume's files; nothing there is fine."""
        path = self.path(volume_id)
        if self.mounted(volume_id):
            try:
                _run("umount", str(path))
            except VolumeFsError:
                _run("umount", "-l", str(path))  # something still holds it open: detach it lazily
        if path.exists():
            shutil.rmtree(path)
        with contextlib.suppress(FileNotFoundError):
            self.image(volume_id).unlink()

    def usage(self, volume_id: str, mode: str) -> tuple[int, int, int, int]:
        """(block_size, blocks, blocks_free, blocks_avail): statvfs of a mounted image; for a plain
        directory its size in 4 KiB blocks is measured (blocks = used, nothing is known to be free)."""
        path = self.path(volume_id)
        if mode == "loop" and self.mounted(volume_id):
            st = os.statvfs(path)
            return st.f_frsize, st.f_blocks, st.f_bfree, st.f_bavail
        used = sum(entry.stat().st_blocks * 512 for entry in path.rglob("*") if entry.is_file()) if path.exists() else 0
        return 4096, used // 4096, 0, 0

    # --------------------------------------------------------------------------------------------
    # snapshots: a tar of the volume's files (owners, modes, times, links kept), restored by untarring

    def archive(self, volume_id: str, into: Path) -> str:
        """Write the volume's files as a tar to `into`; returns its `sha256:` digest."""
        _run("tar", "--create", "--file", str(into), "--numeric-owner", "--sparse", "--exclude=./lost+found",
             "-C", str(self.path(volume_id)), ".")  # fmt: skip
        return file_digest(into)

    def restore(self, volume_id: str, archive: Path) -> None:
        """Unpack a snapshot's tar into the (new, empty) volume; ENOSPC if it does not fit."""
        _run("tar", "--extract", "--file", str(archive), "--numeric-owner", "-C", str(self.path(volume_id)))


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return "sha256:" + digest.hexdigest()
