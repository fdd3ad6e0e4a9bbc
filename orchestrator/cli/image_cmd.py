"""`fauxmad image build|push|ls|inspect|tag|rm`: thin; the format and the store are in `bus.stores.images`."""

from __future__ import annotations

import shlex
import time
from pathlib import Path
from typing import Literal

import msgspec
import typer
from rich import box

from bus.stores.image_push import push_image, remove_image, tag_image
from bus.stores.images import ImageError, ImageManifest, Images, build_archive, check_tag, manifest_for
from bus.transport.connection import connect
from bus.transport.nats_adapter import Nats
from orchestrator.cli.render import FitTable, WideOption, console, print_json
from orchestrator.cli.runtime import JsonOption, NatsOption, fail, with_connected

image_app = typer.Typer(
    help="Images: an app's directory as one content-addressed archive in the fleet's store, pulled by workers.",
    no_args_is_help=True,
)
TagOption = typer.Option(None, "--tag", "-t", help="name:tag to point at it (repeatable)")
AppOption = typer.Option(
    None, "--app", "-a", help="the app it is pushed into (a deployer's push; default: its tags' name)"
)


def _say(line: str) -> None:
    console.print(line, markup=False, highlight=False)


def _tags(tags: list[str] | None) -> list[str]:
    try:
        return [check_tag(t) for t in tags or []]
    except ImageError as exc:
        fail(str(exc), 2)


def build(directory: Path, cmd: str | None, env: list[str] | None, workdir: str) -> tuple[bytes, ImageManifest]:
    """Pack `directory`; the manifest's defaults from the options (`cmd` in shell words)."""
    pairs: dict[str, str] = {}
    for item in env or []:
        name, sep, value = item.partition("=")
        if not sep or not name:
            fail(f"--env {item!r}: use NAME=VALUE", 2)
        pairs[name] = value
    try:
        data = build_archive(directory)
    except (ImageError, OSError) as exc:
        fail(str(exc), 2)
    return data, manifest_for(
        data, cmd=shlex.split(cmd) if cmd else [], env=pairs, workdir=workdir, source=str(directory.resolve())
    )


@image_app.command("build")
def build_command(
    directory: Path = typer.Argument(..., help="the app's directory"),
    tag: list[str] | None = TagOption,
    cmd: str | None = typer.Option(None, "--cmd", help='the default command, e.g. "python3 app.py"'),
    env: list[str] | None = typer.Option(None, "--env", "-e", help="a default NAME=VALUE (repeatable)"),
    workdir: str = typer.Option("", "--workdir", help="where the command runs, relative to the directory"),
    out: Path | None = typer.Option(None, "--out", help="write the archive here instead of pushing it"),
    app: str | None = AppOption,
    nats: str | None = NatsOption,
    json_out: bool = JsonOption,
) -> None:
    """Pack a directory (deterministic: the same tree gives the same digest) and push it to the fleet.

    `fauxmad image build examples/sandwich --tag sandwich:v1 --cmd "python3 app.py"`
    """
    tags = _tags(tag)
    started = time.perf_counter()
    data, manifest = build(directory, cmd, env, workdir)
    if out is not None:
        out.write_bytes(data)
        out.with_name(out.name + ".json").write_bytes(msgspec.json.encode(manifest))
        _show(manifest, json_out, f"built {manifest.digest} ({len(data) / 1e6:.2f} MB) into {out}")
        return

    async def act(nc: Nats) -> None:
        try:
            pushed = await push_image(nc, data, manifest, tags, app=app)
        except ImageError as exc:
            fail(str(exc), 2)
        took = time.perf_counter() - started
        _show(pushed, json_out, f"pushed {pushed.digest} ({len(data) / 1e6:.2f} MB, {took:.2f} s) {' '.join(tags)}")

    with_connected(nats, lambda url: connect(url, "fauxmad-image"), act)


@image_app.command("push")
def push_command(
    archive: Path = typer.Argument(..., help="an archive written by `image build --out`"),
    tag: list[str] | None = TagOption,
    app: str | None = AppOption,
    nats: str | None = NatsOption,
    json_out: bool = JsonOption,
) -> None:
    """Push an archive built earlier (`image build DIR --out FILE`) with its manifest (FILE.json).

    The archive must hash to the manifest's digest: other bytes (damaged, tampered) are refused and nothing
    is stored or tagged. A stored object that is damaged is replaced."""
    tags = _tags(tag)
    try:
        data = archive.read_bytes()
        manifest = msgspec.json.decode(archive.with_name(archive.name + ".json").read_bytes(), type=ImageManifest)
    except (OSError, msgspec.DecodeError) as exc:
        fail(f"{archive}: {exc}", 2)

    async def act(nc: Nats) -> None:
        try:
            pushed = await push_image(nc, data, manifest, tags, app=app)
        except ImageError as exc:
            fail(str(exc), 2)
        _show(pushed, json_out, f"pushed {pushed.digest} {' '.join(tags)}")

    with_connected(nats, lambda url: connect(url, "fauxmad-image"), act)


@image_app.command("import")
def import_command(
    layout: Path = typer.Argument(..., help="an OCI image layout directory (umoci, skopeo copy ... oci:DIR)"),
    tag: list[str] | None = TagOption,
    ref: str | None = typer.Option(None, "--ref", help="which image of the layout (its ref.name) if it holds several"),
    app: str | None = AppOption,
    nats: str | None = NatsOption,
    json_out: bool = JsonOption,
) -> None:
    """Import an OCI image layout: layers applied in order (whiteouts honoured), its Entrypoint/Cmd, Env and
    WorkingDir kept in the manifest; pushed like a built image.

    `fauxmad image import ./layout --ref v1 --tag web:v1`
    """
    from orchestrator.oci import import_layout

    tags = _tags(tag)
    try:
        data, manifest = import_layout(layout, ref)
    except (ImageError, OSError, KeyError, ValueError) as exc:
        fail(f"{layout}: {exc}" if not str(exc).startswith(str(layout)) else str(exc), 2)

    async def act(nc: Nats) -> None:
        try:
            pushed = await push_image(nc, data, manifest, tags, app=app)
        except ImageError as exc:
            fail(str(exc), 2)
        _show(pushed, json_out, f"imported {pushed.digest} ({len(data) / 1e6:.2f} MB) {' '.join(tags)}")

    with_connected(nats, lambda url: connect(url, "fauxmad-image"), act)


@image_app.command("ls")
def ls_command(nats: str | None = NatsOption, json_out: bool = JsonOption, wide: bool = WideOption) -> None:
    """The fleet's images: digest, size, tags, when built."""

    async def act(nc: Nats) -> None:
        found = await (await Images.open(nc.jetstream())).list()
        if json_out:
            print_json(found)
            return
        if not found:
            _say("no images (fauxmad image build DIR --tag NAME:TAG)")
            return
        table = FitTable(header_style="bold", box=box.SIMPLE_HEAD, cut_first=("created", "size"))
        for col in ("digest", "size", "created", "tags"):
            justify: Literal["left", "right"] = "right" if col == "size" else "left"
            table.add_column(col, no_wrap=col == "digest", overflow="fold", justify=justify)
        for manifest in found:
            table.add_row(
                manifest.digest[:19],
                human_size(manifest.size),
                iso_utc(manifest.created),
                " ".join(manifest.tags) or "-",
            )
        console.print(table)

    with_connected(nats, lambda url: connect(url, "fauxmad-image"), act)


@image_app.command("inspect")
def inspect_command(
    reference: str = typer.Argument(..., help="name:tag or sha256:..."), nats: str | None = NatsOption
) -> None:
    """An image's manifest (JSON)."""

    async def act(nc: Nats) -> None:
        images = await Images.open(nc.jetstream())
        try:
            manifest = await images.manifest(await images.resolve(reference))
        except ImageError as exc:
            fail(str(exc), 4)
        if manifest is None:  # removed between the two reads
            fail(f"image {reference} has no manifest in the store", 4)
        print_json({**msgspec.structs.asdict(manifest), "created": iso_utc(manifest.created)})

    with_connected(nats, lambda url: connect(url, "fauxmad-image"), act)


@image_app.command("tag")
def tag_command(
    reference: str = typer.Argument(..., help="name:tag or sha256:..."),
    tag: str = typer.Argument(..., help="the new name:tag"),
    nats: str | None = NatsOption,
    json_out: bool = typer.Option(False, "--json", help="print the image's manifest (JSON)"),
) -> None:
    """Point another name:tag at an image (a deployer: a tag of its own app, APP:TAG)."""
    (new,) = _tags([tag])

    async def act(nc: Nats) -> None:
        try:
            manifest = await tag_image(nc, reference, new)
        except ImageError as exc:
            fail(str(exc), 4)
        _show(manifest, json_out, f"{new} -> {manifest.digest}")

    with_connected(nats, lambda url: connect(url, "fauxmad-image"), act)


@image_app.command("rm")
def rm_command(
    reference: str = typer.Argument(..., help="name:tag or sha256:..."),
    app: str | None = typer.Option(
        None, "--app", "-a", help="a deployer: the app whose image a sha256: reference is (a tag names its own)"
    ),
    nats: str | None = NatsOption,
) -> None:
    """Delete an image from the store (workers keep what they unpacked until they evict it). A deployer removes
    only its app's images, and none another app still tags or runs."""

    async def act(nc: Nats) -> None:
        try:
            manifest = await remove_image(nc, reference, app=app)
        except ImageError as exc:
            fail(str(exc), 4)
        _say(f"removed {manifest.digest} {' '.join(manifest.tags)}")

    with_connected(nats, lambda url: connect(url, "fauxmad-image"), act)


def human_size(size: int) -> str:
    """Bytes as people read them: `3,970 B`, `4.0 kB`, `12.3 MB` (decimal units, as `image build` says MB)."""
    if size < 10_000:
        return f"{size:,} B"
    for unit, scale in (("kB", 1e3), ("MB", 1e6), ("GB", 1e9)):
        if size < scale * 1000 or unit == "GB":
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"  # pragma: no cover


def iso_utc(moment: float) -> str:
    """A time as ISO 8601 in UTC, to the second: `2026-11-29T02:51:08Z`."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(moment))


def _show(manifest: ImageManifest, json_out: bool, line: str) -> None:
    if json_out:
        print_json(manifest)
    else:
        _say(line)
