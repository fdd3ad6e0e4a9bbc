"""The worker agent (flyd's role): the only source of truth for the machines on its host.

`store` keeps the append-only op log and the derived tables in LMDB; `lifecycle` is the machine
state machine; `driver`/`process_driver`/`shim` run machines as processes that outlive the agent;
`supervisor` applies restart policies and health checks; `agent` wires it all to the bus.
"""

import bus  # noqa: F401  (first: it defers the aiohttp that nats-py imports and never uses)
