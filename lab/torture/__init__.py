"""The project's own nemesis behind `fauxmad torture`: a mixed workload under a seeded fault schedule, a
recorded history, and a checker over it (Jepsen's shape, with the project's real processes: on one host, or on
hosts of their own with the network's faults too, `fauxmad torture --hosts`).

- `plan`: the seeded fault schedule and client steps (pure: the same seed attempts the same things).
- `fleet`: the processes (nats-server, workers, brokers, the operator): start, kill -9, freeze, restart.
- `workload`: the clients, each its own app, over the brokers' API; every request recorded.
- `nemesis`: carries out the schedule, striking some kills and freezes as a reserve goes out.
- `procs`: this host's machine processes from /proc, and the signals that freeze a host.
- `sampler`: periodic samples, the final snapshot, the operator probe.
- `history`: the records, written as JSONL in the run directory.
- `check`: the checker, a pure function of the history (unit-tested with hand-made histories).
- `run`: ties them in order and renders the report.

No typer and no rich here: the CLI (`lab/cli/torture_cmd.py`) parses options and prints.
"""
