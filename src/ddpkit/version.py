"""ddpkit's version: written into every snapshot and shown by ``ddpkit --version``."""

__version__ = "0.2.0"
