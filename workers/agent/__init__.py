"""The worker agent process: one module per job, each importable on its own.

`service` wires the machine manager to the bus (connects, subscribes, closes); `handlers` answers its
endpoints and `routes` says which method answers each verb; `heartbeat` keeps the registry current,
`compaction` trims the op log, `images` feeds the image cache; `runner` runs one or more agents in a
process; `config` is what a worker is started with.
"""
