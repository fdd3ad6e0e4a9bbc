"""Signal names as requests spell them (`TERM`, `SIGKILL`, `9`), checked into numbers.

`stop`, `signal` and a resumed `stopping` machine all take a signal by name; one parser means
one rule for what is a 400, and the oddities of `int()` on Unicode digits are handled once.
"""

from __future__ import annotations

import signal as signals

from bus.contract.errors import BadRequest


def parse_signal(name: str) -> int:
    text = name.strip().upper()
    if text.isdigit():
        # ASCII digits only, and few: int() refuses '²' (a digit to isdigit) and over 4,300 digits (a 500),
        # and reads '٣' as 3 (SIGQUIT, which no caller meant)
        number = int(text) if text.isascii() and len(text) <= 3 else 0
        if 0 < number < signals.NSIG:
            return number
    else:
        if not text.startswith("SIG"):
            text = "SIG" + text
        value = getattr(signals.Signals, text, None)
        if isinstance(value, signals.Signals):
            return int(value)
    raise BadRequest(f"unknown signal {name!r}")
