"""A job submit from the command line's options and, with `-c fauxmad.toml`, the app's `[jobs]` defaults.

Options given win over the spec; the spec's `[jobs]` wins over the app's own `cmd`, `env` and `guest`. A job
runs in `--image`, else the spec's `image` (the app's); with an image and no command from either, the
image's own command (the worker that takes the submit resolves the image and finds it).
"""

from __future__ import annotations

import msgspec

from bus.contract.base import seconds
from bus.contract.jobs import JobSubmitRequest
from orchestrator.apps.spec import AppSpec, JobsSpec


class SubmitOptions(msgspec.Struct, kw_only=True):
    app: str | None = None
    region: str | None = None
    cmd: list[str] = []
    env: dict[str, str] = {}
    count: int = 1
    cpus: int | None = None
    memory_mb: int | None = None
    timeout: str | None = None
    max_attempts: int | None = None
    idempotency_key: str | None = None
    runner: str | None = None
    image: str | None = None


def submit_request(options: SubmitOptions, spec: AppSpec | None) -> tuple[str, JobSubmitRequest]:
    """(the region, the request); ValueError (one line) for anything missing or invalid."""
    jobs = (spec.jobs if spec is not None else None) or JobsSpec()
    app = options.app or (spec.app if spec is not None else None)
    if not app:
        raise ValueError("no app: pass --app, or -c with an app spec")
    region = options.region or jobs.region
    if not region:
        raise ValueError("no region: pass --region, or set `region` under [jobs] in the spec")
    cmd = options.cmd or jobs.cmd or (list(spec.cmd) if spec is not None else [])
    image = options.image or (spec.image if spec is not None else None)
    if not cmd and not image:
        raise ValueError("no command: give it after --, set `cmd` under [jobs] in the spec, or give an --image")
    env = {**(spec.env if spec is not None else {}), **options.env}
    raw = {
        "app": app,
        "cmd": cmd,
        "env": env,
        "count": options.count,
        "cpus": options.cpus or jobs.cpus,
        "memory_mb": options.memory_mb or jobs.memory_mb,
        "timeout": seconds(options.timeout) if options.timeout else seconds(jobs.timeout),
        "max_attempts": options.max_attempts or jobs.max_attempts,
        "runner": options.runner or jobs.runner,
    }
    if options.idempotency_key is not None:
        raw["idempotency_key"] = options.idempotency_key
    if image:
        raw["image"] = image
    try:
        return region, msgspec.convert(raw, JobSubmitRequest)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid job: {exc}") from None
