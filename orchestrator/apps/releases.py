"""Releases: an app's desired state, kept in KV `fauxmad_apps` (the only state the reconcilers have).

Keys, per app:
- `<app>.releases.<N>`: release N, the spec it deploys and its status (running, complete, failed,
  rolled_back). Numbers only grow; `kv.create` claims a number, so two deployers never share one.
- `<app>.current`: which release the fleet should run. A rollback points it at an older release
  instead of copying that release under a new number, so machines already on it are left alone.
- `<app>.deploying`: who is converging the app right now (a deploy, a rollback), until when (`Claim`). The
  operators leave an app so claimed alone: two reconcilers planning one app at once each created the missing
  primary, then each destroyed the other's copy as the surplus, and a region had none (the nemesis on hosts,
  seed 101). A claim lapses at `until` unless renewed, so a deploy killed halfway holds nobody up for long.

Every write is a whole value; there is nothing to merge. A reconciler reads `current`, then the
release it names, and converges the machines onto it. The bucket is a `ReleaseStore` (see `store`), so
this module never sees nats-py, and a unit test keeps releases in a dict.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Literal

import msgspec

from bus.contract.codec import decoder, encode
from bus.contract.errors import Conflict, NotFound
from bus.contract.subjects import matches
from orchestrator.apps.spec import AppSpec
from orchestrator.apps.store import ReleaseStore

Status = Literal["running", "complete", "failed", "rolled_back"]


def app_of_key(key: str) -> str | None:
    """The app a key of the apps bucket belongs to, when it says the app has releases (its `current` pointer or
    a release), else None."""
    if matches("*.current", key) or matches("*.releases.*", key):
        return key.split(".", 1)[0]
    return None


class Release(msgspec.Struct, kw_only=True):
    app: str
    version: int
    spec: AppSpec
    status: Status = "running"
    description: str = ""
    reason: str = ""
    created_at: float = 0.0
    updated_at: float = 0.0
    previous: int | None = None  # the release the app ran when this one was made: where a failure goes back to


class Claim(msgspec.Struct, kw_only=True):
    """A deploy (or rollback) converging `app` onto `release`, held by `holder` until `until` (its clock)."""

    app: str
    holder: str
    release: int
    until: float

    def live(self, now: float) -> bool:
        return now < self.until


class Head(msgspec.Struct, kw_only=True):
    """Which release an app should run; `version` 0 with `destroyed`: the app is being torn down."""

    app: str
    version: int
    destroyed: bool = False
    updated_at: float = 0.0


def _release_key(app: str, version: int) -> str:
    return f"{app}.releases.{version}"


def _head_key(app: str) -> str:
    return f"{app}.current"


def _claim_key(app: str) -> str:
    return f"{app}.deploying"


class WatchedReleases:
    """What the apps bucket's watch has shown: each app's head and releases, decoded as they arrive.

    An operator reads the desired state from the bucket, and falls back on this when the bucket does not
    answer: a supercluster region cut off from the home region (which keeps the bucket) still knows every app
    deployed before the cut and the release it should run, even when its own reads failed until then."""

    def __init__(self) -> None:
        self._heads: dict[str, Head] = {}
        self._releases: dict[tuple[str, int], Release] = {}
        self._claims: dict[str, Claim] = {}

    def apply(self, key: str, value: bytes | None) -> None:
        """One watch entry (`value=None`: deleted or purged). Values that do not decode are ignored."""
        app, _, rest = key.partition(".")
        try:
            if rest == "current":
                if value is None:
                    self._heads.pop(app, None)
                else:
                    self._heads[app] = decoder(Head).decode(value)
            elif rest == "deploying":
                if value is None:
                    self._claims.pop(app, None)
                else:
                    self._claims[app] = decoder(Claim).decode(value)
            elif matches("releases.*", rest) and rest.split(".")[1].isdigit():
                version = int(rest.split(".")[1])
                if value is None:
                    self._releases.pop((app, version), None)
                else:
                    self._releases[(app, version)] = decoder(Release).decode(value)
        except msgspec.DecodeError:
            return

    def apps(self) -> set[str]:
        return set(self._heads) | {app for app, _ in self._releases}

    def head(self, app: str) -> Head | None:
        return self._heads.get(app)

    def release(self, app: str, version: int) -> Release | None:
        return self._releases.get((app, version))

    def claim(self, app: str) -> Claim | None:
        return self._claims.get(app)


class Releases:
    def __init__(self, kv: ReleaseStore, *, clock: Callable[[], float] = time.time) -> None:
        self.kv = kv
        self.clock = clock

    async def _keys(self, pattern: str) -> list[str]:
        # filtered at this end: nats-py's server-side key filters return nothing with some servers
        return [key for key in await self.kv.keys() if matches(pattern, key)]

    async def apps(self) -> list[str]:
        """Apps with a current release or any release at all (a first deploy that failed leaves no current)."""
        return sorted({app for app in map(app_of_key, await self._keys(">")) if app is not None})

    async def list(self, app: str) -> list[Release]:
        out = []
        for key in await self._keys(f"{app}.releases.*"):
            value = await self.kv.get(key)
            if value is not None:  # purged since the keys were listed
                out.append(decoder(Release).decode(value))
        out.sort(key=lambda r: r.version)
        return out

    async def get(self, app: str, version: int) -> Release:
        value = await self.kv.get(_release_key(app, version))
        if value is None:
            raise NotFound(f"app {app} has no release v{version}")
        release: Release = decoder(Release).decode(value)
        return release

    async def head(self, app: str) -> Head | None:
        value = await self.kv.get(_head_key(app))
        if value is None:
            return None
        head: Head = decoder(Head).decode(value)
        return head

    async def current(self, app: str) -> Release | None:
        head = await self.head(app)
        if head is None or head.destroyed or head.version == 0:
            return None
        return await self.get(app, head.version)

    async def next_version(self, app: str) -> int:
        """The number the next release would claim (another deployer may take it first)."""
        existing = await self._keys(f"{app}.releases.*")
        return max((int(k.rsplit(".", 1)[1]) for k in existing), default=0) + 1

    async def create(self, spec: AppSpec, description: str, previous: int | None = None) -> Release:
        """Claim the next release number for `spec` (status running); `current` is not moved yet."""
        version = await self.next_version(spec.app)
        for _ in range(100):
            now = self.clock()
            release = Release(
                app=spec.app,
                version=version,
                spec=spec,
                description=description,
                created_at=now,
                updated_at=now,
                previous=previous,
            )
            if await self.kv.create(_release_key(spec.app, version), encode(release)):
                return release
            version += 1  # another deployer took this number
        raise Conflict(f"could not claim a release number for {spec.app}")

    async def point(self, app: str, version: int, *, destroyed: bool = False) -> None:
        await self.kv.put(
            _head_key(app), encode(Head(app=app, version=version, destroyed=destroyed, updated_at=self.clock()))
        )

    async def claim(self, app: str, holder: str, release: int, ttl: float) -> Claim:
        """Say that `holder` converges `app` onto `release` for the next `ttl` seconds (written again to renew)."""
        claim = Claim(app=app, holder=holder, release=release, until=self.clock() + ttl)
        await self.kv.put(_claim_key(app), encode(claim))
        return claim

    async def claim_of(self, app: str) -> Claim | None:
        """Who converges `app` now, if anyone (a lapsed claim is None)."""
        value = await self.kv.get(_claim_key(app))
        if value is None:
            return None
        try:
            claim: Claim = decoder(Claim).decode(value)
        except msgspec.DecodeError:
            return None
        return claim if claim.live(self.clock()) else None

    async def unclaim(self, app: str, holder: str) -> None:
        """`holder` is done with `app`: its claim goes (one another holder wrote since is left alone)."""
        value = await self.kv.get(_claim_key(app))
        if value is None:
            return
        with contextlib.suppress(msgspec.DecodeError):
            if decoder(Claim).decode(value).holder != holder:
                return
        await self.kv.purge(_claim_key(app))

    async def forget_head(self, app: str) -> None:
        """The app has no current release (as before its first deploy); its releases stay."""
        await self.kv.purge(_head_key(app))

    async def set_status(self, app: str, version: int, status: Status, reason: str = "") -> Release:
        """Record what became of a release. `failed` is history: a failed release keeps that status and its
        reason forever, whatever happens later (a rollback away from it, a forced rollback onto it). For the
        other statuses the reason is a note on the status and goes with it."""
        release = await self.get(app, version)
        if release.status == "failed":
            return release
        release.status = status
        release.reason = reason
        release.updated_at = self.clock()
        await self.kv.put(_release_key(app, version), encode(release))
        return release

    async def previous_good(self, app: str, before: int) -> Release | None:
        """The newest complete release older than `before`: where an automatic rollback goes."""
        good = [r for r in await self.list(app) if r.version < before and r.status == "complete"]
        return good[-1] if good else None

    async def last_good(self, app: str, besides: int) -> Release | None:
        """The newest complete release other than `besides`: where a failed rollback returns."""
        good = [r for r in await self.list(app) if r.version != besides and r.status == "complete"]
        return good[-1] if good else None

    async def purge(self, app: str) -> None:
        for key in await self._keys(f"{app}.>"):
            await self.kv.purge(key)
