"""`fauxmad machine ...`: run and manage machines through the broker API."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from typing import Any

import typer

from orchestrator.cli.render import console, explain_table, machines_table, print_json
from orchestrator.cli.runtime import NATS_HELP, check_app, check_machine_id, check_region, fail, with_client

machine_app = typer.Typer(help="Run and manage machines (through the brokers).", no_args_is_help=True)

NATS = typer.Option(None, "--nats", help=NATS_HELP, show_default=False)
APP = typer.Option(..., "--app", "-a", help="the app the machine belongs to", callback=check_app)
MACHINE_ID = typer.Argument(..., help="machine id", callback=check_machine_id)
JSON = typer.Option(False, "--json", help="print JSON instead of a table")


def _parse_env(pairs: list[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            fail(f"invalid --env {pair!r}: use KEY=VALUE")
        env[key] = value
    return env


@machine_app.command("run", context_settings={"allow_interspersed_args": False})
def run_machine(
    cmd: list[str] = typer.Argument(..., help="the command to run, after --"),
    app: str = APP,
    region: str = typer.Option(
        ..., "--region", "-r", help="the region to place it in (never another)", callback=check_region
    ),
    cpus: int = typer.Option(1, "--cpus", min=1, help="cpus to reserve"),
    memory_mb: int = typer.Option(256, "--memory-mb", min=1, help="memory to reserve and enforce"),
    restart: str = typer.Option("on-failure", "--restart", help="restart policy: no, always, on-failure"),
    env: list[str] = typer.Option([], "--env", "-e", help="KEY=VALUE, repeatable"),
    name: str | None = typer.Option(None, "--name", help="a name for the machine"),
    image: str | None = typer.Option(None, "--image", help="an image name (scored: cached images win ties)"),
    explain: bool = typer.Option(False, "--explain", help="show every worker's scores and why the winner won"),
    strategy: str | None = typer.Option(None, "--strategy", help="scatter, p2c or hedged"),
    skip_launch: bool = typer.Option(False, "--skip-launch", help="reserve only (state created)"),
    idempotency_key: str | None = typer.Option(None, "--idempotency-key", help="retry-safe create"),
    nats: str | None = NATS,
    json_out: bool = JSON,
) -> None:
    """Place a machine in a region and start it: `fauxmad machine run -a web -r mad -- python app.py`."""
    import msgspec

    from bus.messages import CreateRequest, Guest, MachineConfig, RestartPolicy

    try:
        config = MachineConfig(
            cmd=cmd,
            env=_parse_env(env),
            image=image,
            guest=Guest(cpus=cpus, memory_mb=memory_mb),
            restart=RestartPolicy(policy=restart),  # type: ignore[arg-type]
        )
        request = CreateRequest(
            region=region,
            config=config,
            name=name,
            explain=explain,
            strategy=strategy,  # type: ignore[arg-type]
            skip_launch=skip_launch,
            idempotency_key=idempotency_key,
        )
        request = msgspec.convert(msgspec.to_builtins(request), CreateRequest)  # validate like the broker will
    except (msgspec.ValidationError, ValueError) as exc:
        fail(f"invalid machine: {exc}")
    machine = with_client(nats, lambda c: c.create(app, request))
    if json_out:
        print_json(machine)
        return
    console.print(machines_table([machine]))
    if explain and machine.explain:
        console.print(explain_table(machine.explain))


@machine_app.command("list")
def list_machines(
    app: str = APP,
    state: str | None = typer.Option(None, "--state", help="only this state"),
    all_: bool = typer.Option(False, "--all", help="include destroyed machines"),
    nats: str | None = NATS,
    json_out: bool = JSON,
) -> None:
    """List an app's machines across every region."""
    machines = with_client(nats, lambda c: c.list(app, state=state, include_destroyed=all_))
    if json_out:
        print_json(machines)
    elif not machines:
        console.print(f"no machines in app {app}")
    else:
        console.print(machines_table(machines))


@machine_app.command("show")
def show(machine_id: str = MACHINE_ID, app: str = APP, nats: str | None = NATS, json_out: bool = JSON) -> None:
    """Show one machine with its recent events."""
    machine = with_client(nats, lambda c: c.get(app, machine_id))
    if json_out:
        print_json(machine)
        return
    console.print(machines_table([machine]))
    for event in machine.events or []:
        console.print(f"  {event.seq:>6}  {event.type:<10} {event.status:<10} {event.reason or ''}")


def _verb(verb: str, help_text: str) -> None:
    def command(
        machine_id: str = MACHINE_ID,
        app: str = APP,
        force: bool = typer.Option(False, "--force", help="destroy: kill a running machine"),
        nats: str | None = NATS,
        json_out: bool = JSON,
    ) -> None:
        async def act(c: Any) -> Any:
            if verb == "destroy":
                return await c.destroy(app, machine_id, force=force)
            return await getattr(c, verb)(app, machine_id)

        machine = with_client(nats, act)
        if json_out:
            print_json(machine)
        else:
            console.print(f"{machine.id} {machine.state}")

    command.__doc__ = help_text
    machine_app.command(verb)(command)


_verb("start", "Start a stopped or created machine.")
_verb("stop", "Stop a machine (SIGTERM, then SIGKILL after 10 s).")
_verb("destroy", "Destroy a machine and release its resources (--force if it is running).")


@machine_app.command("wait")
def wait(
    machine_id: str = MACHINE_ID,
    app: str = APP,
    state: str = typer.Option("started", "--state", help="the state to wait for"),
    timeout: float = typer.Option(60.0, "--timeout", min=0, help="seconds"),
    nats: str | None = NATS,
    json_out: bool = JSON,
) -> None:
    """Wait until a machine reaches a state (exit 1 on timeout)."""
    machine = with_client(nats, lambda c: c.wait(app, machine_id, state, timeout))
    if json_out:
        print_json(machine)
    else:
        console.print(f"{machine.id} {machine.state}")


@machine_app.command("logs")
def logs(
    machine_id: str = MACHINE_ID,
    app: str = APP,
    follow: bool = typer.Option(True, "--follow/--no-follow", help="keep following new lines"),
    nats: str | None = NATS,
    json_out: bool = JSON,
) -> None:
    """Follow a machine's stdout and stderr (published by its worker on fauxmad.v1.logs.APP.ID)."""
    from bus import subjects
    from bus.codec import decoder
    from bus.messages import LogLine

    async def follow_logs(client: Any) -> None:
        await client.get(app, machine_id)  # 404 early for an unknown machine
        done = asyncio.Event()

        async def on_line(msg: Any) -> None:
            line = decoder(LogLine).decode(msg.data)
            if json_out:
                sys.stdout.write(msg.data.decode() + "\n")
            else:
                prefix = "[red]err[/]" if line.stream == "stderr" else "out"
                console.print(f"{prefix} {line.line}", markup=True, highlight=False)
            sys.stdout.flush()

        await client.nc.subscribe(subjects.logs(app, machine_id), cb=on_line)
        if follow:
            await done.wait()
        else:
            await asyncio.sleep(1.0)

    with contextlib.suppress(KeyboardInterrupt):
        with_client(nats, follow_logs)
