"""Background jobs, the client's side: submit, status, list, cancel, wait, logs over the job subjects,
and the `[jobs]` section of `fauxmad.toml`. Workers run the jobs (`workers/jobs`); this package only
speaks the contract."""
