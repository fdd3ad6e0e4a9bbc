"""The Machines API over HTTP, after Fly's: a stateless translator between Fly's paths and the brokers' subjects.

It holds no state but one NATS connection, so any number can run; every request becomes one request on the
bus (through `orchestrator.client.FleetClient`), never a call into broker internals.
"""
