"""The worker's op log: what it keeps in LMDB (`store`, `records`, group `commit`), the legal transitions
of machines and volumes (`machine_states`, `volume_states`), and how every committed transition reaches
NATS (`outbox`, over the bus's `batch_publish`). Above the driver, below the lifecycle.
"""
