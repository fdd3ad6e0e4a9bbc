"""The worker's Prometheus metrics (`fauxmad worker --metrics-listen HOST:PORT`): what an operator watches
on a host. Requests by verb and outcome with their latency (a reserve's is the placement's worker leg),
commits with their batch sizes and durations (each one fsync'd: the floor under every verb), machines by
state, restarts, and check results. prometheus_client's own registry and HTTP server; its counters are
thread-safe, so the commit thread counts its own."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 60)

REQUESTS = Counter("fauxmad_worker_requests_total", "machine verbs answered", ["verb", "outcome"])
REQUEST_SECONDS = Histogram("fauxmad_worker_request_seconds", "machine verb latency", ["verb"], buckets=FAST)
COMMITS = Counter("fauxmad_worker_commits_total", "LMDB write transactions committed (each fsync'd)")
COMMIT_BATCH = Histogram(
    "fauxmad_worker_commit_batch_size", "operations per commit (group commit)", buckets=(1, 2, 4, 8, 16, 32, 64, 256)
)
COMMIT_SECONDS = Histogram("fauxmad_worker_commit_seconds", "one commit, fsync included", buckets=FAST)
MACHINES = Gauge("fauxmad_worker_machines", "machines on this worker by state", ["state"])
RESTARTS = Counter("fauxmad_worker_restarts_total", "machine processes restarted by their restart policy")
CHECKS = Counter("fauxmad_worker_check_results_total", "health check results", ["status"])


def set_machine_states(counts: dict[str, int], known: set[str]) -> None:
    """Set the per-state gauge; states seen before and now empty go to 0 rather than vanishing."""
    known.update(counts)
    for state in known:
        MACHINES.labels(state).set(counts.get(state, 0))
