"""msgspec's validation messages in words: the field and its rule, never a regex or a schema path.

msgspec says ``Expected `str` matching regex '^[0-9a-f]{14}$' - at `$.id` ``; a person wants
"machine id must be 14 hex digits". `in_words` rewrites such a message wherever it sits in a line
(`invalid request: Expected ...`), with a table from the contract's constrained types (ids, names)
to their rules in words; a pattern the table does not know loses its regex all the same ("is not in
the expected form"). msgspec's other messages already say the rule in words (`Expected `int` >= 1 -
at `$.config.guest.cpus``) and are kept as they are.
It is applied where messages are made: the decoding edge (`codec`), the HTTP API, the app spec, and
the CLI's one place that prints errors.
"""

from __future__ import annotations

import re
from typing import Any, get_type_hints

from bus.contract.base import MachineId, Name, SnapshotId, Token, VolumeId
from bus.contract.images import Digest, ImageTag, UploadId
from bus.contract.jobs import JobId
from bus.contract.machines import Mount

TOKEN_RULE = "1-64 letters, digits, '-' or '_'"


def _pattern(kind: Any) -> str:
    pattern: str = kind.__metadata__[0].pattern
    return pattern


def _field_pattern(struct: Any, field: str) -> str:
    return _pattern(get_type_hints(struct, include_extras=True)[field])


# a pattern of the contract -> (what a value of it is, or None: say the field's name; its rule in words)
RULES: dict[str, tuple[str | None, str]] = {
    _pattern(MachineId): ("machine id", "14 hex digits (0-9, a-f)"),
    _pattern(Token): (None, TOKEN_RULE),
    _pattern(Name): (None, "a letter or digit followed by up to 62 letters, digits, '-' or '_'"),
    _pattern(VolumeId): ("volume id", "vol_ and 16 lowercase letters or digits"),
    _pattern(SnapshotId): ("snapshot id", "vs_ and 16 lowercase letters or digits"),
    _pattern(JobId): ("job id", "j and 15 hex digits (0-9, a-f)"),
    _pattern(Digest): ("digest", "sha256: and 64 hex digits"),
    _pattern(ImageTag): ("image tag", "NAME:TAG (a lowercase name, a colon, a tag of letters, digits, '-' or '_')"),
    _pattern(UploadId): ("upload id", "32 hex digits"),
    _field_pattern(Mount, "path"): (None, "an absolute path (starting with /)"),
}

_REGEX = re.compile(
    r"Expected `str` matching regex '(?P<pattern>.*?)'(?: - at `(?P<at>[^`]*)`(?: in `(?P<in>[^`]*)`)?)?$"
)


def _key(path: str | None) -> str:
    """`$.config.guest.cpus` -> `config.guest.cpus` (the key as a spec or a request spells it)."""
    return (path or "").removeprefix("$").removeprefix(".")


def _words(name: str) -> str:
    return name.replace("_", " ")


def _regex_rule(pattern: str, key: str, within: str | None, quote: bool) -> str:
    noun, rule = RULES.get(pattern, (None, None))
    leaf = re.sub(r"\[\d+\]$", "", key.rsplit(".", 1)[-1])
    if quote:  # a file's key, as the file spells it
        key, within = (f"`{key}`" if key else key), (f"`{_key(within)}`" if within else within)
    if within is not None:  # a key of a table (`regions`, `env`, ...)
        subject = f"each key of {_key(within) or 'the table'}"
    elif noun is not None and not quote and (not key or leaf == "id" or _words(leaf) == noun):
        subject = noun
    elif noun is not None:
        subject = f"{key} ({noun})"
    else:
        subject = key or "the value"
    if rule is None:
        return f"{subject} is not in the expected form"  # the generic fallback: no regex shown
    return f"{subject} must be {rule}"


def in_words(message: str, *, quote: bool = False) -> str:
    """`message` with msgspec's regex message in it said in words (the rest of the line kept); other
    messages are msgspec's own sentences (`Expected `int` >= 1 - at `$.config.guest.cpus``), kept.
    `quote`: name the field as a file's key, in backquotes (the app spec's messages)."""
    match = _REGEX.search(message)
    if match is not None:
        said = _regex_rule(match["pattern"], _key(match["at"]), match["in"], quote)
        return message[: match.start()] + said
    # the fallback: a regex in any other shape is dropped all the same
    return re.sub(r" matching regex '.*?'(?= - at |$)", " in the expected form", message)
