"""Sandboxes: a machine in its own pid, mount, ipc and uts namespaces, with bubblewrap (`bwrap`).

Why bubblewrap: it is the small, setuid-free tool Flatpak runs every app in, packaged by Debian, and it
does one thing (build namespaces and mounts, then exec) with no daemon and no image format. The machine
keeps the host's network (ports stay how machines are reached) and everything the process driver gives
a plain machine: its cgroups and rlimits (the shim joins them before it execs bwrap, and namespaces do
not leave cgroups), its log files, its environment, crash safety (the shim stays the parent).

What a sandboxed machine sees (`bwrap_argv`):
- the host's /usr read-only, and /bin, /lib, /lib64, /sbin as the host has them (symlinks into /usr on
  a merged-/usr system, read-only binds otherwise); a few files of /etc that programs need to resolve
  names, users and certificates, read-only; nothing else of the host's root;
- its own directories read-write at the same paths (the machine's workdir with its logs and status
  files, and the directory it runs in), a private /tmp, a fresh /proc (only its own processes) and
  a minimal /dev;
- its volumes read-write at their mount paths (`config.mounts`);
- its machine id as host name; the rest of its root (bwrap's tmpfs) is read-only.

Signals and exit codes. `--new-session` puts the sandbox (bwrap's little init and the workload) in a
session and process group of their own, whose id is the pid bwrap reports on `--info-fd`; the shim
writes that pid to `child.pid`, so the driver's signals go to the workload and never to the outer
bwrap (which would die of a SIGTERM and lose the workload's exit status). bwrap's init reports a
workload killed by signal N as exit code 128 + N (as Docker does); the shim turns that back into
"killed by signal N", so a sandboxed machine's exit reads like a plain one's (a workload that itself
exits with 129..192 reads as a signal: the one ambiguity, documented).
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Sequence

BWRAP = "bwrap"
# Paths of /etc that name resolution, user lookup, TLS and time zones read; bound read-only when present.
ETC_FILES = (
    "/etc/resolv.conf",
    "/etc/hosts",
    "/etc/nsswitch.conf",
    "/etc/passwd",
    "/etc/group",
    "/etc/localtime",
    "/etc/ssl",
    "/etc/ca-certificates",
    "/etc/alternatives",
    "/etc/ld.so.cache",
)
ROOT_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


class SandboxUnavailable(Exception):
    """The machine asks for a sandbox this host cannot provide."""


@functools.lru_cache(maxsize=1)
def bwrap_path() -> str | None:
    return shutil.which(BWRAP)


def available() -> list[str]:
    """The sandboxes this host can run besides "none", for offers and heartbeats."""
    return ["bwrap"] if bwrap_path() else []


def check(sandbox: str, worker_id: str) -> None:
    """Raise `SandboxUnavailable` (in plain words) if this host cannot run `sandbox`."""
    if sandbox != "none" and sandbox not in available():
        raise SandboxUnavailable(
            f"guest.sandbox {sandbox!r}: bubblewrap (bwrap) is not installed on worker {worker_id}"
            " (Debian: apt-get install bubblewrap)"
        )


def bwrap_argv(
    bwrap: str,
    cmd: Sequence[str],
    *,
    hostname: str,
    writable: Sequence[str],
    cwd: str,
    readonly: Sequence[str] = (),
    root_dirs: Sequence[str] = ROOT_DIRS,
    etc_files: Sequence[str] = ETC_FILES,
    binds: Sequence[tuple[str, str]] = (),
) -> list[str]:
    """The command line that runs `cmd` in a sandbox: see the module docstring for what it sees.

    `writable` are host directories bound read-write at the same paths (they must exist); `cwd` is where
    `cmd` starts (one of them, or below one). `binds` are (host directory, path inside) pairs bound
    read-write: a machine's volumes at their mount paths. Pure but for looking at which root directories are
    symlinks.
    """
    argv = [bwrap, "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--new-session", "--hostname", hostname]
    argv += ["--ro-bind", "/usr", "/usr"]
    for path in root_dirs:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    for path in etc_files:
        argv += ["--ro-bind-try", path, path]
    argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    # after /tmp: a machine directory under /tmp (a dev fleet's) is bound over the private /tmp
    for path in dict.fromkeys(writable):
        argv += ["--bind", path, path]
    for path in dict.fromkeys(readonly):  # an image: shared by machines, written by none
        argv += ["--ro-bind", path, path]
    # volumes (docs/tutorials/images-and-volumes.md): bwrap makes the mount point in its own root
    for host, inside in binds:
        argv += ["--bind", host, inside]
    argv += ["--remount-ro", "/", "--chdir", cwd, "--", *cmd]  # the sandbox's own root: read-only too
    return argv
