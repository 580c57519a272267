"""`speechlm sweep`: run an experiment matrix (languages × configs × seeds) on every free GPU slot.

No database and no broker: the job list (`matrix.json`), one resolved config per job and the shared
`status.json` live in one directory on a filesystem every machine mounts; dispatchers claim jobs under
an `fcntl` lock there (store.py). Modules: spec.py (spec → matrix), store.py (locked state),
dispatch.py (the dispatcher loop), view.py (status and report), cli.py (the subcommands, Slurm script).
"""
