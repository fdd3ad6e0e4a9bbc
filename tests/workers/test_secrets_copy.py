"""A worker whose fleet-wide secrets bucket does not answer at its start (its region cut off from the home region)
starts from its sealed copy on disk, and one with no copy refuses to open secrets rather than start without them.

Found by the nemesis on hosts (seed 103): a worker restarted in a cut-off region could not come up. The bucket here
is a fake that answers nothing (what is under test is the cache's choice, not NATS); a worker over real NATS in a
cut-off region is in tests/supercluster/test_restart_in_a_cut_region.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from bus.stores.secrets import SealedSecret, load_private_key, new_private_key, public_key_text, seal
from tests.helpers import arun
from workers.secrets import SecretsCache, SecretsUnavailable


class Silent:
    """A bucket that never answers."""

    async def get(self, key: str) -> Any:
        raise TimeoutError

    async def create(self, key: str, value: bytes) -> int:
        raise TimeoutError

    async def watchall(self) -> Any:
        raise TimeoutError


def test_a_worker_whose_secrets_do_not_answer_starts_from_its_copy_on_disk(tmp_path: Path) -> None:
    key = load_private_key(new_private_key())
    saved = tmp_path / "secrets.sealed.json"
    sealed = SealedSecret(sealed=seal(public_key_text(key), "hunter2"), version=1, updated_at=0.0)
    saved.write_bytes(msgspec.json.encode({"web": {"PASSWORD": sealed}}))

    async def main() -> dict[str, str]:
        cache = SecretsCache(key, saved=saved)
        await cache.start(Silent())
        try:
            return cache.env_for("web")
        finally:
            await cache.close()

    assert arun(main()) == {"PASSWORD": "hunter2"}


def test_a_worker_with_no_copy_refuses_to_open_secrets_until_they_answer(tmp_path: Path) -> None:
    async def main() -> None:
        cache = SecretsCache(load_private_key(new_private_key()), saved=tmp_path / "secrets.sealed.json")
        await cache.start(Silent())
        try:
            with pytest.raises(SecretsUnavailable, match="have not answered since this worker started"):
                cache.env_for("web")
        finally:
            await cache.close()

    arun(main())
