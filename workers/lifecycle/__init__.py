"""The machine lifecycle: every verb (`manager`), the one way a machine changes (`recorder`), callers
waiting for a state (`waiters`), the processes watched and restarted (`supervisor`, `restart_policy`),
re-adoption after a restart (`resume`), health checks, and the counts hot paths answer from (`tally`).
Above the log, below the agent.
"""
