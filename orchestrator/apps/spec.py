"""The app spec, `fauxmad.toml`: desired state as a user writes it, decoded into strict Structs.

tomllib reads the file and msgspec converts it, so an unknown key or a wrong type is refused before
anything touches the fleet, with one line that names the key (`deploy.max_unavailble: unknown key`).
The machine config every primary and spare of a release runs is derived here and nowhere else.

Paths in a spec are relative to the spec file's directory, as in a compose file: `workdir` (where
`cmd` runs) defaults to that directory and is stored absolute in the release, so `cmd = ["python3",
"app.py"]` finds the `app.py` next to the spec. That directory must then exist on every worker's host (it
does with `fauxmad dev`); with `build` (a directory packed into an image at deploy) or `image` (a tag or
digest of the fleet's store) the machines run in the image instead, and `workdir` is not allowed.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
import typing
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from bus.contract.base import Cpus, MemoryMb, Token, seconds
from bus.contract.fleet import Preset
from bus.contract.machines import Check, Guest, MachineConfig, Mount, RestartPolicy, Service
from bus.contract.rules import in_words
from orchestrator.apps.http_service import HttpService

RELEASE_KEY = "fauxmad_release"
ROLE_KEY = "fauxmad_role"
REPLACES_KEY = "fauxmad_replaces"
PRIMARY = "primary"
SPARE = "spare"

Count = Annotated[int, msgspec.Meta(ge=0, le=1000)]
STRATEGIES = ("rolling", "canary", "bluegreen", "immediate")


class SpecError(ValueError):
    """A spec that cannot be used; the message is one line naming the file and the key."""


class _Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    pass


class DeploySpec(_Strict, frozen=True):
    strategy: Literal["rolling", "canary", "bluegreen", "immediate"] = "rolling"
    # a fraction of a region's count (0 < x < 1, rounded up) or a number of machines (an integer >= 1)
    max_unavailable: int | float = 0.33
    spares: Annotated[int, msgspec.Meta(ge=0, le=8)] = 0
    wait_timeout: float | str = "60s"

    def __post_init__(self) -> None:
        value = self.max_unavailable
        if isinstance(value, float) and not 0 < value <= 1:
            raise ValueError("max_unavailable must be a fraction in (0, 1] or a whole number of machines >= 1")
        if isinstance(value, int) and value < 1:
            raise ValueError("max_unavailable must be a fraction in (0, 1] or a whole number of machines >= 1")
        try:
            seconds(self.wait_timeout)
        except ValueError as exc:
            raise ValueError(f"wait_timeout: {exc}") from None

    def unavailable_budget(self, count: int) -> int:
        """How many of `count` primaries may be down at once (at least one)."""
        value = self.max_unavailable
        if isinstance(value, float):
            return max(1, math.ceil(value * count - 1e-9))
        return value

    @property
    def wait_seconds(self) -> float:
        return seconds(self.wait_timeout)


class PlacementSpec(_Strict, frozen=True):
    """How the brokers score workers for this app's machines. The spec only names a preset; what it means
    (the curves) is the brokers' business, so it travels on every create rather than being resolved here."""

    preset: Preset | None = None  # the brokers' named policies (placement/config.py PRESETS); None: their own curves


class JobsSpec(_Strict, frozen=True):
    """`[jobs]`: the defaults of `fauxmad job submit -c fauxmad.toml` for this app (docs/how-to/jobs.md)."""

    region: Token | None = None
    cmd: list[str] = []  # default: the app's `cmd`
    cpus: Cpus = 1
    memory_mb: MemoryMb = 256
    timeout: float | str = "1h"
    max_attempts: Annotated[int, msgspec.Meta(ge=1, le=100)] = 3
    runner: Literal["machine", "process"] = "machine"

    def __post_init__(self) -> None:
        try:
            seconds(self.timeout)
        except ValueError as exc:
            raise ValueError(f"timeout: {exc}") from None


class AppSpec(_Strict, frozen=True):
    app: Token
    cmd: list[str] = []  # required unless an image (or `build`) gives a default command
    image: str | None = None  # `name:tag` or `sha256:...`; a release pins the digest
    build: str | None = None  # a directory (relative to the spec) that deploy packs and pushes as the image
    workdir: str | None = None  # absolute once loaded from a file; None: the machine's own directory
    env: dict[str, str] = {}
    guest: Guest = msgspec.field(default_factory=Guest)
    regions: dict[Token, Count] = {}
    restart: RestartPolicy = msgspec.field(default_factory=RestartPolicy)
    checks: dict[Token, Check] = {}
    deploy: DeploySpec = msgspec.field(default_factory=DeploySpec)
    placement: PlacementSpec = msgspec.field(default_factory=PlacementSpec)
    http_service: HttpService | None = None  # read by `fauxmad proxy` only (docs/tutorials/edge.md)
    mounts: list[Mount] = []  # `[[mounts]] volume = "vol_...", path = "/data"` (docs/tutorials/images-and-volumes.md)
    jobs: JobsSpec | None = None  # read by `fauxmad job submit -c` only (docs/how-to/jobs.md)

    def __post_init__(self) -> None:
        if not self.regions:
            raise ValueError("[regions] needs at least one `<region> = <count>`")
        if self.workdir is not None and (not self.workdir or "\0" in self.workdir):
            raise ValueError("workdir must be a directory path")
        if self.image is not None and self.build is not None:
            raise ValueError("`image` and `build` both given: use one (build packs a directory into the image)")
        if (self.image is not None or self.build is not None) and self.workdir is not None:
            raise ValueError("`workdir` does not go with `image`/`build`: machines run in the image's directory")
        if not self.cmd and self.image is None and self.build is None:
            raise ValueError("missing required key `cmd` (or an `image`/`build` whose manifest has one)")
        if any(not part for part in self.cmd[:1]):
            raise ValueError("`cmd`: the program must not be empty")
        if self.mounts and (sum(self.regions.values()) > 1 or self.deploy.spares):
            raise ValueError("[[mounts]]: a volume attaches to one machine: use one region with count 1 and no spares")

    def machine_config(
        self, release: int, role: str, standby_of: str | None = None, replaces: str | None = None
    ) -> MachineConfig:
        """The config a machine of this release runs; role and release are labels in its metadata."""
        metadata = {RELEASE_KEY: str(release), ROLE_KEY: role}
        if replaces:
            metadata[REPLACES_KEY] = replaces
        return MachineConfig(
            image=self.image,
            cmd=list(self.cmd),
            workdir=self.workdir,
            env=dict(self.env),
            guest=self.guest,
            restart=self.restart,
            checks=dict(self.checks),
            metadata=metadata,
            standbys=[standby_of] if standby_of else [],
            mounts=list(self.mounts),
            services=self._services(),
        )

    def _services(self) -> list[Service]:
        """The port the edge reaches this app's machines on, when `[http_service]` fixes one: a worker's
        backhaul lets an edge on another host reach only the ports a machine's config names."""
        port = self.http_service.internal_port if self.http_service else None
        return [Service(internal_port=port)] if port else []


_AT = re.compile(r"^(.*) - at `\$\.?(.*)`$")


def _one_line(source: str, exc: msgspec.ValidationError) -> str:
    text = str(exc)
    if "matching regex" in text:  # a name or an id: its rule in words, never the regex
        return f"{source}: {in_words(text, quote=True)}"
    match = _AT.match(text)
    message, path = (match.group(1), match.group(2)) if match else (text, "")
    unknown = re.match(r"Object contains unknown field `(.+)`", message)
    if unknown:
        key = f"{path}.{unknown.group(1)}" if path else unknown.group(1)
        home = "" if path else _table_of(unknown.group(1))
        return f"{source}: unknown key `{key}`" + (f" (it belongs under [{home}])" if home else "")
    missing = re.match(r"Object missing required field `(.+)`", message)
    if missing:
        key = f"{path}.{missing.group(1)}" if path else missing.group(1)
        return f"{source}: missing required key `{key}`"
    message = message[0].lower() + message[1:] if message else message
    return f"{source}: `{path}`: {message}" if path else f"{source}: {message}"


def _table_of(key: str) -> str | None:
    """The table of the spec a top-level `key` belongs in (`cpus`: `guest`), or None."""
    for field in msgspec.structs.fields(AppSpec):
        kinds = typing.get_args(field.type) or (field.type,)  # `HttpService | None`: each
        for kind in kinds:
            if isinstance(kind, type) and issubclass(kind, msgspec.Struct) and key in kind.__struct_fields__:
                return field.name
    return None


_TABLES: dict[str, object] = {"regions": dict[Token, Count], "checks": dict[str, Check]}


def _name_the_key(data: dict[str, object], exc: msgspec.ValidationError) -> msgspec.ValidationError:
    """msgspec says `regions[...]`; find which entry of the table it means, so the message can name it."""
    for table, kind in _TABLES.items():
        entries = data.get(table)
        if f"$.{table}" not in str(exc) or not isinstance(entries, dict):
            continue
        for key, value in entries.items():
            try:
                msgspec.convert({key: value}, kind, strict=True)  # type: ignore[call-overload]
            except msgspec.ValidationError as one:
                text = str(one).replace("$[...]", f"$.{table}.{key}")
                if "at `key`" in text:
                    text = f"invalid name {key!r}: use 1-64 letters, digits, '-' or '_' - at `$.{table}`"
                return msgspec.ValidationError(text)
    return exc


def parse_spec(text: str, source: str = "fauxmad.toml", base: Path | None = None) -> AppSpec:
    """Decode a spec. With `base` (the spec file's directory), `workdir` is made absolute against it and
    defaults to it; without, a relative `workdir` is taken against the current directory and an absent
    one stays absent (the machine's own directory)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{source}: not valid TOML: {exc}") from None
    try:
        spec = msgspec.convert(data, AppSpec, strict=True)
    except msgspec.ValidationError as exc:
        raise SpecError(_one_line(source, _name_the_key(data, exc))) from None
    if spec.image is not None or spec.build is not None:  # its files come from the image, not this host
        if spec.build is None:
            return spec
        return msgspec.structs.replace(spec, build=os.path.normpath(((base or Path.cwd()) / spec.build).absolute()))
    if spec.workdir is None and base is None:
        return spec
    workdir = (base or Path.cwd()) / (spec.workdir or ".")
    return msgspec.structs.replace(spec, workdir=os.path.normpath(workdir.absolute()))


def load_spec(path: Path) -> AppSpec:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SpecError(f"{path}: no such file (pass -c PATH, or run where fauxmad.toml is)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: cannot read: {exc}") from None
    spec = parse_spec(text, str(path), base=path.absolute().parent)
    if spec.build is not None and not Path(spec.build).is_dir():
        raise SpecError(f"{path}: `build`: {spec.build} is not a directory")
    if spec.workdir is not None and not Path(spec.workdir).is_dir():
        raise SpecError(f"{path}: `workdir`: {spec.workdir} is not a directory")
    return spec
