"""The worker's op log: what it keeps in LMDB (`store`, `records`, group `commit`) and the legal transitions
of machines and volumes (`machine_states`, `volume_states`). It knows nothing of NATS: the outbox
(`workers.outbox`) carries every committed transition there. Above the driver, below the lifecycle.
"""
