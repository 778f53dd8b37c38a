"""What a run leaves behind: the run directory (its files named in :mod:`ddpkit.run.paths`), snapshots,
the records (metrics.jsonl and its readers), the ``--log`` loggers, the console display and the plots.

Nothing is re-exported here: import the module you need (``ddpkit plot`` imports only the torch-free ones).
"""
