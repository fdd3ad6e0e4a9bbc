"""Standard output and error that never drop the tail of a write, whatever PYTHONUNBUFFERED says.

Why: with PYTHONUNBUFFERED=1 (or `python -u`, common in container images) Python puts `sys.stdout`'s text layer
straight on the raw file, and that layer does not look at how much of each write the kernel took. A write to a
terminal that a signal interrupts returns the bytes written so far (write(2)), so the rest of the text was lost
without a word: `machine show` in a terminal lost the last 9,607 bytes of a 17,799-byte `env:` line (strace:
`write(1, ..., 17799) = 8192`, then the next line), one run in forty on a loaded host. A buffered layer
between them (`io.BufferedWriter`) writes again until all of it is written.

What "unbuffered" promises a user is kept: every write is flushed at once, so a prompt or a progress line shows
as soon as it is written. Streams that are buffered already (the default) are left as they are.
"""

from __future__ import annotations

import io
import sys


class _FlushedAtOnce(io.TextIOWrapper):
    """A text stream over a buffered writer that flushes after every write, as an unbuffered one shows it."""

    def write(self, text: str) -> int:
        written = super().write(text)
        self.flush()
        return written


def whole(raw: io.RawIOBase, *, encoding: str, errors: str | None) -> io.TextIOWrapper:
    """A text stream over `raw` whose writes are written whole, however little the raw file takes at a time."""
    return _FlushedAtOnce(io.BufferedWriter(raw), encoding=encoding, errors=errors, write_through=True)


def whole_writes() -> None:
    """Put `whole` streams in place of `sys.stdout` and `sys.stderr` where they write straight to the raw file."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not isinstance(stream, io.TextIOWrapper) or not isinstance(stream.buffer, io.RawIOBase):
            continue
        # a file object of its own on the same descriptor (not closing it): the old stream stays usable and
        # its end cannot close this one's
        raw = io.FileIO(stream.fileno(), "w", closefd=False)
        setattr(sys, name, whole(raw, encoding=stream.encoding, errors=stream.errors))
