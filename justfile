# fauxmad tasks. `just --list` shows them.

set shell := ["bash", "-euo", "pipefail", "-c"]

python := env_var_or_default("PYTHON", "python3")

# test files run at a time: two a core. A file's fleets spend about half their time waiting (timers, heartbeats,
# fsyncs, the seeded nemesis's fixed-length runs), so one file a core left the host about half idle
jobs := env_var_or_default("FAUXMAD_TEST_JOBS", `echo $(( 2 * $(nproc) ))`)

# run the whole test suite (real nats-server, real worker processes), two files a core at a time
# (FAUXMAD_TEST_JOBS=N: N at a time, 0: one after another); a failing test names the directory that keeps its fleets' logs
test *args:
    {{python}} -m pytest -q -n {{jobs}} --dist loadfile --durations=25 {{args}}

# the fast layer only: pure functions and single components, no fleet (tests not marked `fleet`)
test-fast *args:
    {{python}} -m pytest -q -m "not fleet" {{args}}

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

# the documentation site (docs/, mkdocs with the Material theme) into site/; --strict: a broken link fails it
docs *args:
    NO_MKDOCS_2_WARNING=1 {{python}} -m mkdocs build --strict {{args}}
