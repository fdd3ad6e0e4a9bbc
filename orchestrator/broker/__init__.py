"""The broker (flaps' role): stateless, any number at once, answering the machines API over NATS.

`auction` turns a create into a placement (scatter, rank, reserve, fill or fail); `routing` finds
the worker that owns a machine; `idempotency` makes a repeated create return the same machine,
whichever broker answers; `service` wires them to the bus as the `fauxmad-broker` micro service.
"""
