"""What a user or a machine wrote is shown as written, never obeyed (issue 41, docs/reference/status-events-logs.md#user-text-in-every-other-output).

A property test: text drawn from markup (`[`, `]`, `[/x]`, `[bold]`), escape sequences (OSC 0 titles,
OSC 52 clipboard writes, colours), control characters, right-to-left marks, emoji and 10 KB lines goes
into a machine's cmd, metadata and env, and out of its stdout as log lines; then every read command
(`machine list`, `machine show`, `status`, `logs`, `events`) runs in a pty 80 columns wide, piped, and with
`--json`. Each exits 0; JSON gives the text back exactly; a pipe gets log lines exactly; a terminal shows
the text with its control characters as escapes (`render.visible`) and receives no control character of
the user's. One dev fleet for the module, one machine per example, six examples (two written, four drawn): bounded.

The examples' machines share one app, so each read command runs once for all six and is judged for each
machine (list, status, logs and events name them all; `machine show` runs per machine): 42 CLI processes
rather than 96, the same examples and the same checks (a CLI process is about 0.3 s of CPU, the whole cost
of this test). Hypothesis only draws the examples (derandomized, no shrinking, as before); a failure names
the example's machine name and text.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from orchestrator.cli.render import visible
from orchestrator.devfleet import DevFleet, FleetSpec
from tests.helpers import ROOT
from tests.orchestrator.cli.test_output_fits import _env, raw_terminal

pytestmark = pytest.mark.fleet

PIECES = [
    "[",
    "]",
    "[/x]",
    "[bold]",
    "[/]",
    "[info]",
    "[link=file:///etc/passwd]x",
    ":smile:",
    "\x1b]0;PWNED\x07",
    "\x1b]52;c;aGVsbG8=\x07",
    "\x1b[31mRED",
    "\x1b[2J\x1b[H",
    "\x07",
    "\x08",
    "\r",
    "\x0b\x0c",
    "\x7f",
    "\x9b31m",
    "\t",
    "\u200f",
    "\u202e",
    "\u2066",
    "🙂",
    "👩‍👩‍👧",
    "مرحبا",
    "\\x1b",
    "%s{}",
    " ",
]
CHARS = st.characters(codec="utf-8", exclude_characters="\x00\n")  # NUL: no argv; \n: a new line
FRAGMENT = st.one_of(st.sampled_from(PIECES), st.text(CHARS, min_size=1, max_size=6))
SHORT = st.lists(FRAGMENT, min_size=1, max_size=10).map("".join)


def _long(text: str) -> str:
    """`text` repeated to a 10 KB line (in UTF-8; the worker keeps 16 KB of a line, workers/output.py)."""
    return (text * (10_240 // len(text) + 1)).encode()[:10_240].decode(errors="ignore")


LONG = SHORT.map(_long)
TEXT = st.one_of(SHORT, SHORT, LONG)
NAME = st.from_regex(r"[a-z0-9][a-z0-9_-]{0,20}", fullmatch=True)

# The machine prints its argument and its env value, each as one line, byte for byte, then stays up.
SAY = (
    "import os, sys, time\n"
    "out = sys.stdout.buffer\n"
    "out.write(os.fsencode(sys.argv[1]) + b'\\n')\n"
    "out.write(os.environb[b'SAID'] + b'\\n')\n"
    "out.flush()\n"
    "time.sleep(900)\n"
)
USER_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")  # all but \t, \n, \r (the pty's line ends)
SGR = re.compile(r"\x1b\[[0-9;]*m")  # rich's own styles
counter = itertools.count()


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    spec = FleetSpec(regions=["mad"], workers_per_region=1, cpus=64, memory_mb=8192)
    with DevFleet(spec) as running:
        yield running.url


def ok(url: str, *args: str) -> str:
    """The command's stdout through a pipe, as it wrote it (no newline translation: a `\r` stays one)."""
    result = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, env=_env(url), timeout=120, cwd=ROOT
    )
    stderr = result.stderr.decode(errors="replace")
    assert result.returncode == 0, (args[:3], stderr[-2000:])
    assert "Traceback" not in stderr
    return result.stdout.decode()


def as_json(url: str, *args: str) -> Any:
    end = args.index("--") if "--" in args else len(args)  # after `--`, it would be the machine's
    return json.loads(ok(url, *args[:end], "--json", *args[end:]))


def shown(url: str, *args: str) -> str:
    """The command's output in a pty 80 columns wide: it exits 0, and no control character of the user's
    reaches the terminal (rich's own colours aside)."""
    raw = raw_terminal(url, *args, columns=80)
    plain = SGR.sub("", raw)
    stray = USER_CONTROL.search(plain)
    assert stray is None, f"{args[:3]}: {plain[max(0, stray.start() - 40) : stray.end() + 40]!r}"
    return plain.replace("\r\n", "\n")


def has_line(text: str, line: str) -> None:
    """`line` is a whole line of `text`; if not, the failure says where the nearest line that starts the same
    way first differs (CI30 and CI33 lost a 10 KB `env:` line of `machine show` in a pty, and pytest's own
    message cut the output in the middle, where the difference was)."""
    if f"\n{line}\n" in f"\n{text}":
        return
    head = line[: line.index("=") + 1] if "=" in line else line[:8]
    found = [got for got in text.split("\n") if got.startswith(head)]
    if not found:
        raise AssertionError(f"no line starts with {head!r} in {len(text)} characters: {text[:300]!r}...")
    got = found[0]
    at = next((i for i, (a, b) in enumerate(zip(got, line, strict=False)) if a != b), min(len(got), len(line)))
    raise AssertionError(
        f"{head!r}: the line has {len(got)} characters, {len(line)} wanted; they differ at {at}: "
        f"got {got[max(0, at - 60) : at + 60]!r}, wanted {line[max(0, at - 60) : at + 60]!r}"
    )


def logs_of(url: str, app: str, count: int) -> list[dict[str, Any]]:
    for _ in range(80):  # the lines reach the logs stream shortly after the machine printed them
        # one object a "\n" (not splitlines(): a line of JSON may hold U+0085 or U+2028, which JSON leaves as they are)
        lines = [json.loads(line) for line in ok(url, "logs", "--app", app, "--json").split("\n") if line]
        if len(lines) >= count:
            return lines
        time.sleep(0.25)
    raise AssertionError(f"the machine's {count} lines never reached the logs of {app}")


# Drawn examples per run: each is a machine and its `machine show`s, so the suite draws 4 beside the explicit ones
# (the same strategies; derandomized, so each run judges the same draws); FAUXMAD_USER_TEXT_EXAMPLES=50 draws more,
# for a run that looks for new cases rather than guards the known ones.
EXAMPLES = int(os.environ.get("FAUXMAD_USER_TEXT_EXAMPLES", "4"))
PER_APP = 6  # examples judged together: 12 log lines, well inside `logs`' 100 by default


@dataclass(frozen=True)
class Case:
    name: str
    said: str
    meta: str
    env: str


def cases() -> list[Case]:
    """The examples, as hypothesis gives them: the written ones, then EXAMPLES drawn (derandomized: the same every
    run; a random draw found a \r case)."""
    found: list[Case] = []

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: what is drawn is what is judged
        suppress_health_check=[HealthCheck.too_slow],
        database=None,
        derandomize=True,
    )
    @given(name=NAME, said=TEXT, meta=TEXT, env=TEXT)
    @example(name="talk", said="[info] hello [/x] world", meta="[bold]x[/bold]", env="\x1b]0;PWNED\x07\x1b[31mRED")
    # a fresh-clone CI run's draw (before derandomize): a 10 KB env value of CRs, C1 and C0 bytes and a character of
    # the astral plane (two columns wide), beside a 10 KB command line; `machine show` in a terminal missed its line
    @example(
        name="0nsmyr",
        said=_long(" \xa6%B\xa8\xde\x1b[31mREDL"),
        meta="\x1b]0;PWNED\x07",
        env=_long("\r\x9d\x16\U000262c93\x17\xb6?\xbf\x07\x96O"),
    )
    def draw(name: str, said: str, meta: str, env: str) -> None:
        found.append(Case(name, said, meta, env))

    draw()
    return found


def test_the_examples_are_the_written_two_and_the_drawn_ones() -> None:
    """What the fleet test judges: both written examples and EXAMPLES more, drawn the same way every run."""
    drawn = cases()
    assert [c.name for c in drawn[:2]] == ["talk", "0nsmyr"] and len(drawn) == 2 + EXAMPLES, drawn
    assert drawn == cases()
    assert any(len(c.env) >= 10_000 or len(c.said) >= 10_000 for c in drawn[2:])  # a drawn 10 KB line


def test_user_text_is_shown_as_written(url: str) -> None:
    every = cases()
    for at in range(0, len(every), PER_APP):
        batch = every[at : at + PER_APP]
        app = f"said-{next(counter)}"
        machines: list[tuple[dict[str, Any], Case]] = []
        try:
            for case in batch:
                machine = as_json(
                    url,
                    *("machine", "run", "--app", app, "--region", "mad", "--name", case.name, "--memory-mb", "32"),
                    *("--metadata", f"note={case.meta}", "--env", f"SAID={case.env}"),
                    *("--", sys.executable, "-c", SAY, case.said),
                )
                machines.append((machine, case))
            read_back(url, app, machines)
        finally:
            for machine, _ in machines:
                ok(url, "machine", "destroy", machine["id"], "-a", app, "--force")


def read_back(url: str, app: str, machines: list[tuple[dict[str, Any], Case]]) -> None:
    ids = {machine["id"] for machine, _ in machines}

    # --json: exact, wherever the text is
    listed = {found["id"]: found for found in as_json(url, "machine", "list", "--app", app)}
    assert set(listed) == ids
    lines = logs_of(url, app, 2 * len(machines))
    for machine, case in machines:
        mid = machine["id"]
        for found in [listed[mid], as_json(url, "machine", "show", mid, "-a", app)]:
            assert found["name"] == case.name, case
            assert found["config"]["cmd"][-1] == case.said, case
            assert found["config"]["metadata"]["note"] == case.meta, case
            assert found["config"]["env"]["SAID"] == case.env, case
        assert [line["line"] for line in lines if line["machine_id"] == mid] == [case.said, case.env], case
    assert {m["id"] for m in as_json(url, "status", "--app", app)["machines"]} == ids

    # piped: log lines exact; `machine show` as written, control characters visible
    logs = ok(url, "logs", "--app", app)
    for machine, case in machines:
        mid = machine["id"]
        assert f" {mid} stdout | {case.said}\n" in logs and f" {mid} stdout | {case.env}\n" in logs, case
        show = ok(url, "machine", "show", mid, "-a", app)
        has_line(show, f"  cmd: {visible(' '.join(machine['config']['cmd']), keep=chr(10))}")
        has_line(show, f"  metadata: note={visible(case.meta)}")
        has_line(show, f"  env: SAID={visible(case.env)}")
        assert re.search(rf"(?<![\w-]){re.escape(case.name)}(?![\w-])", show), case
    for command in (["machine", "list"], ["status"], ["events"]):
        said = ok(url, *command, "--app", app)
        assert all(mid in said for mid in ids), (command, said)

    # a terminal: the same text, its control characters as escapes, none of them obeyed
    logs = shown(url, "logs", "--app", app)
    for machine, case in machines:
        mid = machine["id"]
        said, env = visible(case.said, keep=chr(9)), visible(case.env, keep=chr(9))
        assert f" {mid} stdout | {said}\n" in logs and f" {mid} stdout | {env}\n" in logs, case
        show = shown(url, "machine", "show", mid, "-a", app)
        has_line(show, f"  metadata: note={visible(case.meta)}")
        has_line(show, f"  env: SAID={visible(case.env)}")
    for command in (["machine", "list"], ["status"]):
        seen = shown(url, *command, "--app", app)
        assert all(mid in seen for mid in ids), (command, seen)
    shown(url, "events", "--app", app)
