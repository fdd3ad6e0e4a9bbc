"""What a broker reads of an app's current release (KV `fauxmad_apps`, as deploys write it:
`orchestrator/apps/releases.py`): only what its checks need, whether the edge serves the app (an
`[http_service]`: the edge verbs) and which image the release pins (an `image rm`). Decoded into those two fields
alone, so a broker never depends on the reconciler's whole spec, and a spec field added later never breaks it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from bus.transport.nats_adapter import NotFoundError


class _Head(msgspec.Struct):
    version: int = 0
    destroyed: bool = False


class CurrentSpec(msgspec.Struct):
    http_service: dict[str, Any] | None = None
    image: str | None = None  # a digest once deployed (a release pins it)


class _Release(msgspec.Struct):
    spec: CurrentSpec


async def current_spec(apps: Any, app: str) -> CurrentSpec | None:
    """`app`'s current release's spec, None when it has none (never deployed, destroyed, or unreadable); a KV that
    cannot answer raises."""
    try:
        head = msgspec.json.decode((await apps.get(f"{app}.current")).value or b"{}", type=_Head)
        if head.destroyed or head.version <= 0:
            return None
        release = (await apps.get(f"{app}.releases.{head.version}")).value or b"{}"
        return msgspec.json.decode(release, type=_Release).spec
    except (NotFoundError, msgspec.DecodeError, msgspec.ValidationError):
        return None
