"""Talking over NATS: connections, scatter-gather, services that turn exceptions into error replies, and
the JetStream resources and fast paths every process uses. Above the contract, below everything else.
"""
