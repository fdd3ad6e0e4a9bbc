"""What the fleet keeps in JetStream besides the contract's own buckets: images, app secrets, volume
snapshots, the audit trail, and the object-store plumbing they share.
"""
