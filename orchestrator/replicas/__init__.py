"""Replicas of the fleet: what brokers, reconcilers and the view know about workers and machines, in memory.

Each is a local copy of a KV bucket kept current by a watch (`replica`): `workers` is the live-worker
registry (KV `fauxmad_workers`, heartbeats with a TTL), `machines` the routing index (KV
`fauxmad_machines`, machine -> worker, state and labels). They live here rather than in the broker
because the broker is only one of their readers: the reconciler, the CLI and the view read them too,
and none of those should reach into broker internals to do it.
"""
