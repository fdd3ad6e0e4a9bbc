"""The systemwide view (Corrosion's role in the seed design): replication, not consensus.

Each worker is the source of truth for its own machines and publishes every transition on
`fauxmad.v1.events...`, captured by stream `FAUXMAD_EVENTS`. The view is a materialized replica of
that stream (plus the heartbeats in KV `fauxmad_workers`) in a local SQLite file, so `status`, the
live view and list queries answer without asking every worker.

Modules: `model` (the records a snapshot is made of, and the JSON shape), `db` (the SQLite file:
schema, connection, transactions), `fold` (the write side: events and heartbeats in, idempotently),
`query` (the read side: snapshots out), `follower` (keeps the view current from the bus), `history`
(events straight from the stream), `paths` (where the file lives). No typer or rich here: the CLI renders.
"""
