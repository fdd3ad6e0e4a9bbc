"""Background jobs on the worker: the job desk (submit, status, list, cancel), the slot-bounded pull
from the region's work queue, and the runner that carries each taken job through one attempt."""
