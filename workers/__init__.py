"""The worker agent (flyd's role): the only source of truth for the machines on its host.

Layers, each a package, the lower never importing the higher (`just lint` checks it): `driver` runs
machines as processes that outlive the agent; `log` keeps the append-only op log and the derived tables in
LMDB; `outbox` gets every committed transition to NATS; `lifecycle` holds the verbs, the supervisor and the
restart policy; `jobs` runs background jobs; `agent` wires it all to the bus.
"""

import bus  # noqa: F401  (first: it defers the aiohttp that nats-py imports and never uses)
