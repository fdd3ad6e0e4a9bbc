"""The client-side reconciler: from an app spec to machines in place, run by the CLI (deploy, rollback, reconcile,
drain) rather than by a server.

An app's spec and releases are the app model's (`orchestrator.apps`). One module per stage: `observe` (what the
workers say), `plan` (a pure `plan(desired, observed, now) -> Plan`, with its `actions`, `failover` and `spares`),
`preview` (a deploy simulated), `executor` (the plan applied over the bus) and `reconciler` (one pass, and passes
until converged). The loops built on it are one module each: `rollout` (deploy, rollback, reconcile once), `watch`
(the operator), `drain` and `destroy`; `follow` keeps a connected reconciler's replicas current and wakes it on
changes. `ports` names what they need of the bus, the brokers, the KV and the clock, as Protocols; `over_nats`
satisfies them with NATS, and the unit tests with an in-memory fleet and a clock that nobody waits for.
"""
