"""Where the view's SQLite file lives by default: a cache, one per fleet (per NATS URL).

`$FAUXMAD_VIEW` names the file outright; otherwise it goes under `$FAUXMAD_HOME/cache`, else
`$XDG_CACHE_HOME/fauxmad`, else `~/.cache/fauxmad`, named after a hash of the NATS URL so two
fleets never share one. A fleet that reuses a URL is caught by the stream's identity check.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

VIEW_ENV = "FAUXMAD_VIEW"
HOME_ENV = "FAUXMAD_HOME"


def cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    if environ.get(HOME_ENV):
        return Path(environ[HOME_ENV]) / "cache"
    base = environ.get("XDG_CACHE_HOME") or str(Path(environ.get("HOME") or Path.home()) / ".cache")
    return Path(base) / "fauxmad"


def default_view_path(nats_url: str, environ: Mapping[str, str] = os.environ) -> Path:
    if environ.get(VIEW_ENV):
        return Path(environ[VIEW_ENV])
    digest = hashlib.sha256(nats_url.encode()).hexdigest()[:12]
    return cache_dir(environ) / f"view-{digest}.sqlite"
