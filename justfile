# fauxmad tasks. `just --list` shows them.

set shell := ["bash", "-euo", "pipefail", "-c"]

python := env_var_or_default("PYTHON", "python3")

# run the whole test suite (real nats-server, real worker processes)
test *args:
    {{python}} -m pytest -q --durations=25 {{args}}

# ruff (lint and format), mypy, and the layering contracts (import-linter)
lint:
    ruff check .
    ruff format --check .
    mypy
    lint-imports

# start a dev fleet, run the sample app in three regions, show where it landed, stop
demo *args:
    fauxmad demo {{args}}

# a local fleet in the foreground: NATS, workers in three regions, a broker
dev *args:
    fauxmad dev {{args}}

# measure placement latency and throughput (writes bench-placement.json)
bench *args:
    fauxmad bench placement {{args}}

# measure the worker: reserve latency over NATS, commits/s, restart time, RSS
bench-worker *args:
    fauxmad bench worker {{args}}
