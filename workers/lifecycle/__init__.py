"""The machine lifecycle: every verb, orchestrated (`manager`, its settings in `config`), and the verbs' parts,
one job each: leases (`leases`), whether a reserve is taken and its first record (`reservation`), what a
process runs with (`launch_spec`), suspend and resume (`pause`), a new config (`update`); the one way a
machine changes (`recorder`), callers waiting for a state (`waiters`), the processes watched and restarted
(`supervisor`, `restart_policy`), re-adoption after a restart (`resume`), the fence after an absence
(`fence`), health checks, and the counts hot paths answer from (`tally`). Above the log, below the agent.
"""
