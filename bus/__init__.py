"""The bus: everything fauxmad's processes say to each other over NATS.

Workers and the orchestrator never import each other; they meet here. `contract` is what they say (subjects,
messages, errors, the codec, the machine-readable schema) and imports nothing else of fauxmad; `transport`
is how they say it over NATS (connections, scatter-gather, services, JetStream resources); `stores` what the
fleet keeps in JetStream (images, secrets, snapshots); `local` the servers a developer's host starts. It
imports neither `workers` nor `orchestrator`, nor any CLI library.
"""

from bus.transport import lazy_aiohttp

lazy_aiohttp.defer()
