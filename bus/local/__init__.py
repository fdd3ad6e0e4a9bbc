"""Servers this host starts for development and tests: a nats-server, a loopback supercluster with
gateway relays to partition it, and free ports for them. Never used by a production process.
"""
