"""Security for a fleet: identities per role, permissions per subject (enforced by nats-server), mTLS."""
