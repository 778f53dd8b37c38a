"""Processes and the process group: the launch (parent side), the worker entry (child side), the
distributed context every rank gets, where a failure becomes one line, and the environment
variables all of these read and set.

    from ddpkit.ranks.context import distributed       # with distributed("auto", 600) as ctx: ...
    from ddpkit.ranks.launcher import launch           # launch(fn, *args, nproc=2): fn(ctx, *args) per rank

Nothing is re-exported here, so the CLI can import :mod:`ddpkit.ranks.env` and
:mod:`ddpkit.ranks.failures` without loading torch.
"""
