"""nats-py imports aiohttp at its own import, for a WebSocket transport fauxmad never uses.

That import costs about 220 ms of CPU in every process: every `fauxmad` call, every worker and broker,
every test's subprocess. `defer()` puts a stand-in `aiohttp` module in `sys.modules` first, so the
`import aiohttp` in nats-py binds it without running aiohttp's code. The stand-in has the real module's
spec and nothing else: the first time anything asks it for a name (`aiohttp.web`, `ClientSession`, a
submodule import, which asks for `__path__`), it runs aiohttp's own `__init__` into itself and from then
on is the ordinary module. The processes that use aiohttp (the HTTP API, the jobs bench's baselines)
get it whole and unchanged; the rest never pay for it.

(The standard library's `importlib.util.LazyLoader` does not do here: in 3.11 the `import` statement
itself reads the module's `__spec__`, which makes LazyLoader load at once.)
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any

_DEFERRED = "aiohttp"


class _NotYetLoaded(types.ModuleType):
    """A module whose code runs on the first read of a name it does not have yet."""

    def __getattr__(self, name: str) -> Any:
        spec = self.__spec__
        assert spec is not None and spec.loader is not None
        self.__class__ = types.ModuleType  # type: ignore[assignment]
        self.__file__ = spec.origin
        if spec.submodule_search_locations is not None:
            self.__path__ = list(spec.submodule_search_locations)
        spec.loader.exec_module(self)
        return getattr(self, name)


def defer() -> None:
    """Make `import aiohttp` cheap until aiohttp is used, unless it is already imported or missing."""
    if _DEFERRED in sys.modules:
        return
    spec = importlib.util.find_spec(_DEFERRED)
    if spec is None or spec.loader is None:
        return
    module = _NotYetLoaded(_DEFERRED)
    module.__spec__ = spec
    module.__loader__ = spec.loader
    module.__package__ = _DEFERRED
    sys.modules[_DEFERRED] = module
