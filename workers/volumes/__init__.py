"""Volumes on the worker: the verbs (`verbs`) and where a volume's bytes live (`storage`)."""
