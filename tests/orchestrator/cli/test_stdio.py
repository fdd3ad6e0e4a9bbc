"""The CLI's standard streams write every byte of a long line, even when the file takes a little at a time (a
terminal's write cut short by a signal), and PYTHONUNBUFFERED's streams are put on a buffered writer."""

from __future__ import annotations

import io
import os
import subprocess
import sys

from orchestrator.cli.stdio import whole
from tests.helpers import ROOT

LINE = "  env: SAID=" + "\\x9d\\x16\U000262c93¶?¿" * 1500 + "\n"


class Stingy(io.RawIOBase):
    """A file that takes at most 4,096 bytes a write, as a terminal write interrupted by a signal does."""

    def __init__(self) -> None:
        self.got = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]
        taken = bytes(data[:4096])
        self.got += taken
        return len(taken)


def test_a_long_line_is_written_whole_where_an_unbuffered_stream_loses_its_tail() -> None:
    unbuffered = Stingy()  # how Python makes stdout under PYTHONUNBUFFERED=1: the text layer on the raw file
    io.TextIOWrapper(unbuffered, encoding="utf-8", write_through=True).write(LINE)
    assert len(unbuffered.got) == 4096 < len(LINE.encode())  # the rest is dropped without an error

    stingy = Stingy()
    stream = whole(stingy, encoding="utf-8", errors="strict")
    assert stream.write(LINE) == len(LINE)
    assert stingy.got == LINE.encode()  # all of it, and at once: nothing waits for a flush


def test_the_cli_under_pythonunbuffered_writes_through_a_buffered_writer() -> None:
    probe = (
        "import sys\n"
        "from orchestrator.cli.stdio import whole_writes\n"
        "whole_writes()\n"
        "print(type(sys.stdout.buffer).__name__, type(sys.stderr.buffer).__name__)\n"
        "print('said at once', file=sys.stderr)\n"
    )
    for unbuffered in ("1", ""):
        env = {**os.environ, "PYTHONUNBUFFERED": unbuffered, "PYTHONPATH": str(ROOT)}
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout == "BufferedWriter BufferedWriter\n" and done.stderr == "said at once\n"
