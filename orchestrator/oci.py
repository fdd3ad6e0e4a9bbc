"""Import an OCI image layout (what `umoci`, `skopeo copy ... oci:DIR` or `buildah push oci:DIR` write) as a
fauxmad image: its layers applied in order, whiteouts honoured, and its config's Entrypoint, Cmd, Env and
WorkingDir carried into the manifest. The result is packed like any directory (`bus.stores.images.build_archive`),
so the same image content always gets the same digest, whichever tool made the layout.

OCI layer semantics (image-spec `layer.md`): a file `.wh.NAME` deletes `NAME` from the layers below; a file
`.wh..wh..opq` in a directory hides everything the layers below put in it. Entries are extracted with
tarfile's `data` filter (no absolute paths, no escapes, no devices).

A layout is content-addressed too: every blob read (manifests, config, layers) is hashed and refused
when it is not the digest it is filed under, so a layer damaged on disk is never applied.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from bus.stores.images import ImageError, ImageManifest, build_archive, manifest_for

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
LAYER_TYPES = (
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
)


def _blob(layout: Path, digest: str) -> bytes:
    algorithm, _, hexdigest = digest.partition(":")
    path = layout / "blobs" / algorithm / hexdigest
    if not path.is_file():
        raise ImageError(f"{layout}: blob {digest} is missing")
    data = path.read_bytes()
    if algorithm not in ("sha256", "sha512") or hashlib.new(algorithm, data).hexdigest() != hexdigest:
        raise ImageError(f"{layout}: blob {digest} does not hash to its name: refused (damaged or tampered)")
    return data


def _json_blob(layout: Path, digest: str) -> Any:
    try:
        return json.loads(_blob(layout, digest))
    except json.JSONDecodeError as exc:
        raise ImageError(f"{layout}: blob {digest} is not JSON: {exc}") from None


def _manifest(layout: Path, ref: str | None) -> dict[str, Any]:
    index_path = layout / "index.json"
    if not index_path.is_file():
        raise ImageError(f"{layout} is not an OCI image layout (no index.json)")
    entries = json.loads(index_path.read_text()).get("manifests", [])
    if ref is not None:
        entries = [e for e in entries if e.get("annotations", {}).get("org.opencontainers.image.ref.name") == ref]
    if not entries:
        raise ImageError(f"{layout}: no image {('tagged ' + ref) if ref else 'in index.json'}")
    if len(entries) > 1:
        names = [e.get("annotations", {}).get("org.opencontainers.image.ref.name", "?") for e in entries]
        raise ImageError(f"{layout} holds {len(entries)} images ({', '.join(names)}): pick one with --ref")
    found: dict[str, Any] = _json_blob(layout, entries[0]["digest"])
    if "layers" not in found:  # an index of platforms: take the first
        found = _json_blob(layout, found["manifests"][0]["digest"])
    return found


def apply_layer(data: bytes, root: Path) -> None:
    """One layer onto `root`: whiteouts delete from what is there, then its files are extracted."""
    raw = gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tar:
        members = tar.getmembers()
        keep = []
        for member in members:
            path = Path(member.name)
            if path.name == OPAQUE:
                target = root / path.parent
                if target.is_dir():
                    for child in target.iterdir():
                        shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
            elif path.name.startswith(WHITEOUT):
                target = root / path.parent / path.name[len(WHITEOUT) :]
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target)
                elif target.exists() or target.is_symlink():
                    target.unlink()
            else:
                keep.append(member)
        tar.extractall(root, members=keep, filter="data")


def import_layout(layout: Path, ref: str | None = None) -> tuple[bytes, ImageManifest]:
    """The layout's image as a fauxmad archive and manifest."""
    manifest = _manifest(layout, ref)
    config = _json_blob(layout, manifest["config"]["digest"]).get("config", {}) or {}
    with tempfile.TemporaryDirectory(prefix="fauxmad-oci-") as scratch:
        root = Path(scratch) / "rootfs"
        root.mkdir()
        for layer in manifest.get("layers", []):
            if layer.get("mediaType") not in LAYER_TYPES:
                raise ImageError(f"{layout}: layer type {layer.get('mediaType')!r} is not supported")
            apply_layer(_blob(layout, layer["digest"]), root)
        data = build_archive(root)
    env = dict(item.split("=", 1) for item in config.get("Env") or [] if "=" in item)
    cmd = [*(config.get("Entrypoint") or []), *(config.get("Cmd") or [])]
    workdir = (config.get("WorkingDir") or "").lstrip("/")
    return data, manifest_for(data, cmd=cmd, env=env, workdir=workdir, source=f"oci:{layout}")
