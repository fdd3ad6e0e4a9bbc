"""App secrets end to end on a dev fleet: sealed in KV, opened only in the machine's environment.

Real nats-server, worker and broker processes (the dev fleet gives its workers one secrets key). After
`secrets set` the app's machines are restarted one at a time and see the value; then the secret's bytes
are searched for everywhere else: every message of every stream (events, logs, every KV bucket), the CLI's
JSON outputs, and the workers' data directories (LMDB included). `unset` rolls them again, without it.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

from orchestrator.devfleet import DevFleet, FleetSpec
from tests.helpers import arun, connect_nats, fleet_fixture
from tests.orchestrator.cli.test_cli import fauxmad

APP = "vault"


fleet = fleet_fixture(FleetSpec(regions=["ams"], workers_per_region=2, cpus=2, memory_mb=2048))


def cli(fleet: DevFleet, *args: str) -> tuple[int, str, str]:
    at = args.index("--") if "--" in args else len(args)  # options go before a command's `--`
    done = fauxmad(*args[:at], "--nats", fleet.url, *args[at:])
    return done.returncode, done.stdout, done.stderr


def machines(fleet: DevFleet) -> list[dict[str, object]]:
    code, out, err = cli(fleet, "machine", "list", "-a", APP, "--json")
    assert code == 0, err
    return list(json.loads(out))


def printenv(fleet: DevFleet, machine_id: str, name: str) -> tuple[int, str]:
    code, out, _ = cli(fleet, "machine", "exec", machine_id, "-a", APP, "--", "printenv", name)
    return code, out.strip()


def every_stored_byte(url: str) -> bytes:
    """Every message of every JetStream stream (events, logs, each KV bucket's history), concatenated."""

    async def main() -> bytes:
        nc = await connect_nats(url)
        js = nc.jetstream()
        found = bytearray()
        for info in await js.streams_info():
            name = info.config.name
            last = info.state.last_seq
            for seq in range(info.state.first_seq, last + 1):
                try:
                    msg = await js.get_msg(name, seq)
                except Exception:
                    continue
                found += (msg.subject or "").encode() + b" " + (msg.data or b"") + b"\n"
                if msg.headers:
                    found += json.dumps(msg.headers).encode()
        await nc.close()
        return bytes(found)

    return arun(main())


def test_a_secret_reaches_the_machines_environment_and_nowhere_else(fleet: DevFleet) -> None:
    for _ in range(2):
        code, _, err = cli(fleet, "machine", "run", "-a", APP, "-r", "ams", "--", "sleep", "600")
        assert code == 0, err
    before = {m["id"]: m["version"] for m in machines(fleet)}

    value = "s3cr3t-" + secrets.token_hex(16)
    code, out, err = cli(fleet, "secrets", "set", "-a", APP, f"DB_PASSWORD={value}", "API_TOKEN=t0k")
    assert code == 0, err
    assert "2 machine(s) of vault restarted" in out and value not in out + err

    after = machines(fleet)
    assert {m["id"] for m in after} == set(before)
    assert all(m["state"] == "started" and m["version"] > before[str(m["id"])] for m in after)  # stopped, started
    for machine in after:
        assert printenv(fleet, str(machine["id"]), "DB_PASSWORD") == (0, value)

    code, out, err = cli(fleet, "secrets", "list", "-a", APP, "--json")
    assert code == 0, err
    listed = json.loads(out)
    assert [s["name"] for s in listed] == ["API_TOKEN", "DB_PASSWORD"] and all(s["version"] == 1 for s in listed)

    needle = value.encode()
    outputs = [
        cli(fleet, "status", "--app", APP, "--json"),
        cli(fleet, "machine", "list", "-a", APP, "--json"),
        cli(fleet, "events", "--app", APP, "--json"),
        cli(fleet, "logs", "--app", APP, "--json"),
        cli(fleet, "workers", "--json"),
        cli(fleet, "machine", "explain", str(after[0]["id"]), "-a", APP, "--json"),
    ]
    for _code, out, err in outputs:
        assert needle not in (out + err).encode()
    assert needle not in every_stored_byte(fleet.url)
    for path in Path(fleet.root).rglob("*"):
        if path.is_file() and path.stat().st_size < 512 * 1024 * 1024:
            assert needle not in path.read_bytes(), f"the secret is in {path}"

    code, out, err = cli(fleet, "secrets", "unset", "-a", APP, "DB_PASSWORD")
    assert code == 0, err
    for machine in machines(fleet):
        assert printenv(fleet, str(machine["id"]), "DB_PASSWORD")[0] != 0
        assert printenv(fleet, str(machine["id"]), "API_TOKEN") == (0, "t0k")


def test_bad_secrets_input_is_one_line_and_changes_nothing(fleet: DevFleet) -> None:
    for args in (["NOVALUE"], ["1BAD=x"], ["A.B=x"]):
        code, out, err = cli(fleet, "secrets", "set", "-a", APP, *args)
        assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (args, err)
    code, out, _ = cli(fleet, "secrets", "list", "-a", APP, "--json")
    assert code == 0 and "NOVALUE" not in out and "1BAD" not in out


def test_the_readme_secrets_commands_run_as_written(fleet: DevFleet) -> None:
    import re
    import shlex

    from tests.helpers import ROOT

    section = (
        (ROOT / "docs" / "how-to" / "secure-fleet.md").read_text().split("### Secrets:", 1)[1].split("\n## ", 1)[0]
    )
    [block] = re.findall(r"```bash\n(.*?)```", section, re.S)
    for line in block.strip().splitlines():
        code, out, err = cli(fleet, *shlex.split(line)[1:])
        assert code == 0, f"{line}: {err}"
    code, out, _ = cli(fleet, "secrets", "list", "-a", "web", "--json")
    assert [s["name"] for s in json.loads(out)] == ["DATABASE_URL"]
