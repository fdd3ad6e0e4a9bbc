"""Running a machine's workload: the driver interface (`base`), the process driver (`process`), the fork
server that starts shims cheaply (`fork_server`, and the worker's end of it, `fork_client`), the shim that
outlives the worker (`shim`), sandboxes, limits and the cgroups made ahead. The lowest layer of the worker.
"""
