"""`fauxmad machine ...`: run and manage machines through the broker API.

`run`, `start`, `restart` and `update` (of a running machine) do not stop at "the worker spawned the
process": they watch the machine until it is up (started and still running the same process after
`--wait-up` seconds, or, with checks, every check passing) and exit 1 with the last lines of its
stderr when it exits or crash-loops instead. `--detach` returns at once.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import typer
from typer.core import TyperCommand

from bus.contract.machines import STOP_TIMEOUT_MAX
from orchestrator.cli import logs_cmd
from orchestrator.cli.names import require_app, require_regions
from orchestrator.cli.render import WideOption, console, explain_table, kept_table, machines_table, made_by, print_json
from orchestrator.cli.runtime import (
    EXIT_CONFLICT,
    EXIT_USAGE,
    CliError,
    JsonOption,
    MachineAppOption,
    MachineIdArgument,
    NatsOption,
    check_region,
    fail,
    key_values,
    with_client,
)
from orchestrator.restart import restart_lease

if TYPE_CHECKING:
    from typer._click.core import Context

    from bus.contract.machines import Machine, MachineConfig
    from orchestrator.client import FleetClient


class MachineCommand(TyperCommand):
    """A command of one machine: its id may be a unique prefix of one of the app's (`names.resolve_machine`),
    resolved before the command runs (one list of the app's machines; a whole id costs nothing)."""

    def invoke(self, ctx: Context) -> Any:
        from orchestrator.cli.names import MACHINE_ID_LENGTH, resolve_machine

        given, app = ctx.params.get("machine_id"), ctx.params.get("app")
        if isinstance(given, str) and isinstance(app, str) and len(given) != MACHINE_ID_LENGTH:
            nats = ctx.params.get("nats")
            ctx.params["machine_id"] = with_client(nats, lambda c: resolve_machine(c, app, given))
        return super().invoke(ctx)


machine_app = typer.Typer(help="Run and manage machines (through the brokers).", no_args_is_help=True)

WAIT_UP = typer.Option(
    1.0, "--wait-up", min=0, help="seconds the machine must stay up (with checks: until they all pass)"
)
WAIT_TIMEOUT = typer.Option(60.0, "--wait-timeout", min=0, help="give up waiting for the machine after this long")
DETACH = typer.Option(False, "--detach", "-d", help="do not wait: return once its worker has spawned the process")

EXEC_TIMED_OUT = 124  # as timeout(1)


class Wait(msgspec.Struct, frozen=True):
    up_for: float
    timeout: float
    detach: bool


async def _until_up(
    client: FleetClient, app: str, machine: Machine, wait: Wait, json_out: bool, *, expect_up: bool = True
) -> Machine:
    """`machine` once it is up; else print it (with --json) and fail with why and its stderr's last lines.

    A machine that should be up (`expect_up`: it was started) and is not even starting failed to start (its
    image could not be pulled, a volume not mounted): that fails too, with the reason its events give."""
    from orchestrator.client import failure_reason

    if wait.detach or not expect_up:
        return machine
    ran = machine.state in ("started", "starting")
    if ran:
        result = await client.wait_up(app, machine, up_for=wait.up_for, timeout=wait.timeout)
        if result.up:
            return result.machine
        now, problem = result.machine, result.problem
    else:
        now, problem = machine, ""
    if now.state == "failed" or not problem:  # its events say why (a start that spawned nothing has no exit)
        now = await client.get(app, machine.id)
        reason = failure_reason(now)
        problem = reason if not problem else problem if reason in problem else f"{problem}: {reason}"
    if json_out:
        print_json(now)
    exit_info = now.exit
    ended = now.restarts > machine.restarts or now.state not in ("started", "starting", "replacing")
    tail = exit_info.stderr_tail if exit_info is not None and ended and ran else []  # else: an older run's
    details = ["last lines of its stderr:", *(f"| {line}" for line in tail)] if tail else []
    details.append(f"more: fauxmad machine {'logs' if ran else 'show'} {machine.id} --app {app}")
    verb = "did not stay up" if ran else "did not start"
    raise CliError(f"machine {machine.id} {verb}: {problem}", details=details)


def _print_machine(machine: Machine, json_out: bool) -> None:
    if json_out:
        print_json(machine)
    else:
        console.print(f"{machine.id} {machine.state}")


@machine_app.command("run", context_settings={"allow_interspersed_args": False})
def run_machine(
    cmd: list[str] | None = typer.Argument(
        None, help="the command to run, after -- (default: the --image's own)", show_default=False
    ),
    app: str = MachineAppOption,
    region: str = typer.Option(
        ..., "--region", "-r", help="the region to place it in (never another)", callback=check_region
    ),
    cpus: int = typer.Option(1, "--cpus", min=1, help="cpus to reserve"),
    memory_mb: int = typer.Option(256, "--memory-mb", min=1, help="memory to reserve and enforce"),
    sandbox: str = typer.Option(
        "none",
        "--sandbox",
        help="none, or bwrap: its own pid, mount, ipc and uts namespaces (docs/tutorials/images-and-volumes.md)",
    ),
    restart: str = typer.Option("on-failure", "--restart", help="restart policy: no, always, on-failure"),
    env: list[str] = typer.Option([], "--env", "-e", help="KEY=VALUE, repeatable"),
    metadata: list[str] = typer.Option([], "--metadata", help="KEY=VALUE, repeatable: a label of yours"),
    volume: list[str] = typer.Option(
        [], "--volume", "-v", help="VOLUME_ID:/path, repeatable: mount it (the machine runs on its worker)"
    ),
    name: str | None = typer.Option(None, "--name", help="a name for the machine"),
    image: str | None = typer.Option(
        None, "--image", help="name:tag or sha256:... of an image in the fleet's store (see `fauxmad image`)"
    ),
    explain: bool = typer.Option(False, "--explain", help="show every worker's scores and why the winner won"),
    strategy: str | None = typer.Option(None, "--strategy", help="scatter, p2c or hedged"),
    skip_launch: bool = typer.Option(False, "--skip-launch", help="reserve only (state created)"),
    idempotency_key: str | None = typer.Option(None, "--idempotency-key", help="retry-safe create"),
    wait_up: float = WAIT_UP,
    wait_timeout: float = WAIT_TIMEOUT,
    detach: bool = DETACH,
    nats: str | None = NatsOption,
    json_out: bool = JsonOption,
    wide: bool = WideOption,
) -> None:
    """Place a machine in a region, start it and wait until it is up: `fauxmad machine run -a web -r mad -- CMD`.

    No shell runs CMD: to use `$PORT` (the port the worker gave the machine), start one yourself,
    e.g. `-- sh -c 'exec python3 -m http.server "$PORT"'`. With `--image REF` and no CMD the machine runs
    the image's own command; a REF the fleet's store does not have is an error (exit 2).
    """
    from bus.contract.fleet import CreateRequest

    if not cmd and image is None:
        fail("no command: give it after --, or an --image whose manifest has one", EXIT_USAGE)

    mounts = []
    for item in volume:
        volume_id, sep, path = item.partition(":")
        if not sep:
            fail(f"--volume {item!r}: use VOLUME_ID:/path", EXIT_USAGE)
        mounts.append({"volume": volume_id, "path": path})
    config = {
        "cmd": cmd or [],
        "env": key_values(env),
        "metadata": key_values(metadata, "--metadata"),
        "mounts": mounts,
        "image": image,
        "guest": {"cpus": cpus, "memory_mb": memory_mb, "sandbox": sandbox},
        "restart": {"policy": restart},
    }
    create = {"region": region, "config": config, "name": name, "explain": explain, "strategy": strategy}
    create |= {"skip_launch": skip_launch, "idempotency_key": idempotency_key}
    try:  # made and checked in one step, by the contract's own rules: the broker's decoder checks the same
        request = msgspec.convert(create, CreateRequest)
    except (msgspec.ValidationError, ValueError) as exc:
        fail(f"invalid machine: {exc}", EXIT_USAGE)
    wait = Wait(wait_up, wait_timeout, detach)

    async def place(client: FleetClient) -> Machine:
        nonlocal request
        await require_regions(client, [region])
        if image is not None:  # pinned to its digest; no CMD: the image's own
            request = msgspec.structs.replace(request, config=await _pin(client, request.config, image))
        created = await client.create(app, request)
        machine = await _until_up(client, app, created, wait, json_out, expect_up=not skip_launch)
        machine.explain = created.explain
        return machine

    machine = with_client(nats, place)
    if json_out:
        print_json(machine)
        return
    console.print(machines_table([machine]))
    if explain and machine.explain:
        console.print(explain_table(machine.explain))


@machine_app.command("list")
def list_machines(
    app: str = MachineAppOption,
    state: str | None = typer.Option(None, "--state", help="only this state"),
    all_: bool = typer.Option(False, "--all", help="include destroyed machines"),
    nats: str | None = NatsOption,
    json_out: bool = JsonOption,
    wide: bool = WideOption,
) -> None:
    """List an app's machines across every region."""

    async def listed(client: FleetClient) -> list[Machine]:
        found = await client.list(app, state=state, include_destroyed=all_)
        if not found:
            await require_app(client, app)
        return found

    machines = with_client(nats, listed)
    if json_out:
        print_json(machines)
    elif not machines:
        console.print(f"no machines in app {app}")
    else:
        console.print(machines_table(machines))


@machine_app.command("explain", cls=MachineCommand)
def explain_machine(
    machine_id: str = MachineIdArgument,
    app: str = MachineAppOption,
    nats: str | None = NatsOption,
    json_out: bool = JsonOption,
    wide: bool = WideOption,
) -> None:
    """Why a machine is on its worker: the auction it won, as kept in its `created` event."""
    machine = with_client(nats, lambda c: c.get(app, machine_id))
    kept = next((event.placement for event in machine.events or [] if event.placement), None)
    if kept is None:
        fail(
            f"machine {machine_id} kept no placement (it was reserved straight on its worker, not through a broker)", 4
        )
    if json_out:
        print_json(kept)
        return
    console.print(kept_table(kept))


@machine_app.command("show", cls=MachineCommand)
def show(
    machine_id: str = MachineIdArgument,
    app: str = MachineAppOption,
    nats: str | None = NatsOption,
    json_out: bool = JsonOption,
    wide: bool = WideOption,
) -> None:
    """Show one machine with its recent events."""
    machine = with_client(nats, lambda c: c.get(app, machine_id))
    if json_out:
        print_json(machine)
        return
    console.print(machines_table([machine]))
    origin = made_by(machine)
    if origin is not None:
        console.print(f"  made by: {origin}")
    config = machine.config
    if machine.name:
        console.print(f"  name: {machine.name}")
    if config.cmd:
        console.print(f"  cmd: {' '.join(config.cmd)}")
    for key, value in sorted(config.metadata.items()):
        console.print(f"  metadata: {key}={value}")
    for key, value in sorted(config.env.items()):
        console.print(f"  env: {key}={value}")
    for event in machine.events or []:
        console.print(f"  {event.seq:>6}  {event.type:<10} {event.status:<10} {event.reason or ''}")


@machine_app.command("start", cls=MachineCommand)
def start(
    machine_id: str = MachineIdArgument,
    app: str = MachineAppOption,
    wait_up: float = WAIT_UP,
    wait_timeout: float = WAIT_TIMEOUT,
    detach: bool = DETACH,
    nats: str | None = NatsOption,
    json_out: bool = JsonOption,
) -> None:
    """Start a stopped or created machine and wait until it is up (exit 1 if it exits or crash-loops)."""
    wait = Wait(wait_up, wait_timeout, detach)

    async def act(client: FleetClient) -> Machine:
        return await _until_up(client, app, await client.start(app, machine_id), wait, json_out)

    _print_machine(with_client(nats, act), json_out)


@machine_app.command("restart", cls=MachineCommand)
def restart_machine(
    machine_id: str = MachineIdArgument,
    app: str = MachineAppOption,
    signal: str = typer.Option("SIGTERM", "--signal", "-s", help="the signal that stops it"),
    stop_timeout: float = typer.Option(
        10.0, "--stop-timeout", min=0, max=STOP_TIMEOUT_MAX, help="seconds before SIGKILL"
    ),
    wait_up: float = WAIT_UP,
    wait_timeout: float = WAIT_TIMEOUT,
    detach: bool = DETACH,
    nats: str | None = NatsOption,
    json_out: bool = JsonOption,
) -> None:
    """Stop a machine (if it runs) and start it again; waits until it is up, like `start`. The restart holds a
    lease of its own from the stop to the start, as the HTTP API's does, so an operator that sees the machine
    stopped in between cannot take it first (`orchestrator/restart.py`)."""
    wait = Wait(wait_up, wait_timeout, detach)

    async def act(client: FleetClient) -> Machine:
        held = restart_lease(client.asker(app), machine_id, stop_timeout, holder="a restart through the CLI")
        async with held as lease_nonce:
            await client.stop(app, machine_id, signal=signal, timeout=stop_timeout, lease_nonce=lease_nonce)
            machine = await client.start(app, machine_id, lease_nonce=lease_nonce)
        return await _until_up(client, app, machine, wait, json_out)

    _print_machine(with_client(nats, act), json_out)


async def _pin(client: FleetClient, config: MachineConfig, image: str) -> MachineConfig:
    """`config` with its image, the reference `image`, pinned to the digest `bus.stores.images.resolve_image`
    gives and, with no command, the image's own. A reference the fleet's store does not have: one line, exit
    2 (there is no other meaning for a name: placement's image scorer works on digests, and a name nobody has
    would crash-loop)."""
    from bus.stores.images import ImageError, resolve_image

    try:
        resolved = await resolve_image(client.nc.jetstream(), image)
    except ImageError as exc:
        fail(f"--image: {exc}", EXIT_USAGE)
    cmd = list(config.cmd) or resolved.cmd
    if not cmd:
        fail(f"no command: give it after --, image {image} has none in its manifest", EXIT_USAGE)
    return msgspec.structs.replace(config, image=resolved.digest, cmd=cmd)


@machine_app.command("stop", cls=MachineCommand)
def stop_machine(
    machine_id: str = MachineIdArgument,
    app: str = MachineAppOption,
    signal: str = typer.Option("SIGTERM", "--signal", "-s", help="the signal that asks it to stop"),
    timeout: float = typer.Option(
        10.0, "--timeout", min=0, max=STOP_TIMEOUT_MAX, help="seconds it has to exit after the signal, then SIGKILL"
    ),
    force: bool = typer.Option(False, "--force", help="SIGKILL at once (--timeout 0)"),
    nats: str | None = NatsOption,
    json_out: bool = JsonOption,
) -> None:
    """Stop a machine: --signal (SIGTERM), then SIGKILL after --timeout seconds (10) if it has not exited."""

    async def act(c: FleetClient) -> Machine:
        return await c.stop(app, machine_id, signal=signal, timeout=0.0 if force else timeout)

    _print_machine(with_client(nats, act), json_out)


@machine_app.command("destroy", cls=MachineCommand)
def destroy_machine(
    machine_id: str = MachineIdArgument,
    app: str = MachineAppOption,
    force: bool = typer.Option(False, "--force", help="kill a running machine (else: stop it first)"),
    nats: str | None = NatsOption,
    json_out: bool = JsonOption,
) -> None:
    """Destroy a machine and release its resources (--force if it is running)."""
    from bus.contract.errors import Conflict

    try:
        _print_machine(with_client(nats, lambda c: c.destroy(app, machine_id, force=force)), json_out)
    except Conflict as exc:  # the worker says "stop it first or destroy with force": name the commands
        if force or "destroy with force" not in exc.message:
            raise
        stop = f"`fauxmad machine stop {machine_id} -a {app}`"
        said = exc.message.replace("stop it first or destroy with force", f"stop it first ({stop}) or pass --force")
        fail(said, EXIT_CONFLICT)


# fauxmad's own labels say what made a machine (a release, its role, what it replaces): a clone is nobody's
OWN_LABELS = ("fauxmad_release", "fauxmad_role", "fauxmad_replaces")


def clone_config(config: MachineConfig) -> MachineConfig:
    """`config` for a new machine: the same but for fauxmad's own labels and the standbys (the original's)."""
    metadata = {k: v for k, v in config.metadata.items() if k not in OWN_LABELS}
    return msgspec.structs.replace(config, metadata=metadata, standbys=[])


@machine_app.command("clone", cls=MachineCommand)
def clone_machine(
    machine_id: str = MachineIdArgument,
    app: str = MachineAppOption,
    region: str | None = typer.Option(
        None, "--region", "-r", help="the region to place the clone in (default: the original's)", callback=check_region
    ),
    name: str | None = typer.Option(None, "--name", help="a name for the clone"),
    wait_up: float = WAIT_UP,
    wait_timeout: float = WAIT_TIMEOUT,
    detach: bool = DETACH,
    nats: str | None = NatsOption,
    json_out: bool = JsonOption,
    wide: bool = WideOption,
) -> None:
    """A new machine with this one's config (image, command, env, guest, restart, checks, metadata), placed in
    --region (default: the original's), started and waited for like `run`.

    fauxmad's own labels (its release and role) are not copied: the clone belongs to no release, so no
    deploy or operator counts it or removes it. A machine with volumes is refused: a volume is on one
    worker and mounted by one machine (make another and `machine run --volume`)."""
    from bus.contract.fleet import CreateRequest

    wait = Wait(wait_up, wait_timeout, detach)

    async def clone(client: FleetClient) -> Machine:
        original = await client.get(app, machine_id, events=False)
        if original.config.mounts:
            volumes = ", ".join(m.volume for m in original.config.mounts)
            raise CliError(f"machine {machine_id} mounts {volumes}: clone does not copy volumes", code=EXIT_USAGE)
        request = CreateRequest(region=region or original.region, config=clone_config(original.config), name=name)
        created = await client.create(app, request)
        return await _until_up(client, app, created, wait, json_out)

    machine = with_client(nats, clone)
    if json_out:
        print_json(machine)
        return
    console.print(f"cloned {machine_id} as {machine.id} in {machine.region}")
    console.print(machines_table([machine]))


def _freeze_verb(verb: Literal["suspend", "resume"], help_text: str) -> None:
    def command(
        machine_id: str = MachineIdArgument,
        app: str = MachineAppOption,
        nats: str | None = NatsOption,
        json_out: bool = JsonOption,
        wide: bool = WideOption,
    ) -> None:
        async def act(c: FleetClient) -> Machine:
            return await (c.suspend if verb == "suspend" else c.resume)(app, machine_id)

        _print_machine(with_client(nats, act), json_out)

    command.__doc__ = help_text
    machine_app.command(verb, cls=MachineCommand)(command)


_freeze_verb("suspend", "Freeze a started machine (SIGSTOP of its processes): it keeps its memory, uses no CPU.")
_freeze_verb("resume", "Continue a suspended machine where it was frozen (SIGCONT).")


@machine_app.command("update", cls=MachineCommand)
def update(
    machine_id: str = MachineIdArgument,
    cmd: list[str] | None = typer.Argument(None, help="a new command, after --", show_default=False),
    app: str = MachineAppOption,
    env: list[str] = typer.Option([], "--env", "-e", help="KEY=VALUE to set (the others are kept), repeatable"),
    cpus: int | None = typer.Option(None, "--cpus", min=1, help="cpus to reserve"),
    memory_mb: int | None = typer.Option(None, "--memory-mb", min=1, help="memory to reserve and enforce"),
    image: str | None = typer.Option(None, "--image", help="a new image: name:tag or sha256:... of the fleet's store"),
    restart: str | None = typer.Option(None, "--restart", help="restart policy: no, always, on-failure"),
    wait_up: float = WAIT_UP,
    wait_timeout: float = WAIT_TIMEOUT,
    detach: bool = DETACH,
    nats: str | None = NatsOption,
    json_out: bool = JsonOption,
) -> None:
    """Change a machine's config (a new instance); a running machine restarts with it and is waited for.

    `fauxmad machine update ID -a web --env LEVEL=debug --memory-mb 512 -- python3 app.py --v2`. A new
    --image is pinned to its digest; with no new command, a command that was the old image's becomes the
    new image's, and one given by hand is kept.
    """
    from bus.contract.machines import MachineConfig

    if not (cmd or env or cpus or memory_mb or image or restart):
        fail("nothing to update: give --env, --cpus, --memory-mb, --image, --restart or a command after --", EXIT_USAGE)
    changes = key_values(env)
    wait = Wait(wait_up, wait_timeout, detach)

    async def act(client: FleetClient) -> Machine:
        current = await client.get(app, machine_id, events=False)
        old = current.config
        new_cmd = cmd or old.cmd
        if image is not None and not cmd and await _image_command(client, old.image) == list(old.cmd):
            new_cmd = []  # the old image's command: the new image's takes its place
        was = msgspec.to_builtins(old)
        new: dict[str, Any] = {"cmd": new_cmd, "env": {**old.env, **changes}, "image": image or old.image}
        new["guest"] = {**was["guest"], "cpus": cpus or old.guest.cpus, "memory_mb": memory_mb or old.guest.memory_mb}
        new["restart"] = {**was["restart"], "policy": restart or old.restart.policy}
        try:  # the old config with the changes, made and checked in one step by the contract's rules
            config = msgspec.convert({**was, **new}, MachineConfig)
        except (msgspec.ValidationError, ValueError) as exc:
            fail(f"invalid update: {exc}", EXIT_USAGE)
        if image is not None:
            config = await _pin(client, config, image)
        updated = await client.update(app, machine_id, config)
        running = current.state in ("started", "starting")
        return await _until_up(client, app, updated, wait, json_out, expect_up=running)

    _print_machine(with_client(nats, act), json_out)


async def _image_command(client: FleetClient, reference: str | None) -> list[str] | None:
    """The command of the image `reference` names, or None (no image, or one the store no longer has)."""
    from bus.stores.images import ImageError, is_digest, resolve_image

    if not is_digest(reference):
        return None
    assert reference is not None
    try:
        return (await resolve_image(client.nc.jetstream(), reference)).cmd
    except ImageError:
        return None


@machine_app.command("signal", cls=MachineCommand)
def signal_machine(
    machine_id: str = MachineIdArgument,
    signal: str = typer.Argument(..., help="a signal name or number: SIGHUP, HUP, USR1, 10", show_default=False),
    app: str = MachineAppOption,
    nats: str | None = NatsOption,
    json_out: bool = JsonOption,
) -> None:
    """Send a signal to a started machine's process group."""
    machine = with_client(nats, lambda c: c.signal(app, machine_id, signal))
    if json_out:
        print_json(machine)
    else:
        console.print(f"{machine.id}: sent {signal}", markup=False, highlight=False)


@machine_app.command("exec", cls=MachineCommand)
def exec_machine(
    machine_id: str = MachineIdArgument,
    cmd: list[str] = typer.Argument(..., help="the command, after --", show_default=False),
    app: str = MachineAppOption,
    timeout: float = typer.Option(30.0, "--timeout", min=0.001, max=3600, help="seconds, then it is killed"),
    nats: str | None = NatsOption,
    json_out: bool = typer.Option(False, "--json", help="print {exit_code, signal, timed_out, stdout, stderr}"),
) -> int:
    """Run a command in a started machine (its environment, working directory and limits); exit with its code.

    `fauxmad machine exec ID -a web -- sh -c 'echo $PORT; ls'`. A command killed by signal N exits
    128+N, one that ran out of time 124. Each stream keeps its first 32 KiB.
    """
    reply = with_client(nats, lambda c: c.exec(app, machine_id, cmd, timeout=timeout))
    if reply.timed_out:
        code = EXEC_TIMED_OUT
    elif reply.signal is not None:
        code = 128 + reply.signal
    else:
        code = reply.exit_code if reply.exit_code is not None else 1
    if json_out:
        print_json(reply)
        return code
    sys.stdout.write(reply.stdout)
    sys.stdout.flush()
    sys.stderr.write(reply.stderr)
    if reply.truncated:
        sys.stderr.write("fauxmad: output cut to the first 32 KiB of each stream\n")
    if reply.timed_out:
        sys.stderr.write(f"fauxmad: killed after {timeout:g}s (--timeout)\n")
    elif code:
        sys.stderr.write(f"fauxmad: exit code {code}\n")
    return code


@machine_app.command("wait", cls=MachineCommand)
def wait(
    machine_id: str = MachineIdArgument,
    app: str = MachineAppOption,
    state: str = typer.Option("started", "--state", help="the state to wait for"),
    timeout: float = typer.Option(60.0, "--timeout", min=0, help="seconds"),
    nats: str | None = NatsOption,
    json_out: bool = JsonOption,
) -> None:
    """Wait until a machine reaches a state (exit 1 on timeout)."""
    machine = with_client(nats, lambda c: c.wait(app, machine_id, state, timeout))
    _print_machine(machine, json_out)


machine_app.command("logs", cls=MachineCommand)(logs_cmd.machine_logs)  # history from stream FAUXMAD_LOGS, then follows
