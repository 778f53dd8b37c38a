"""``python -m ddpkit ...`` (also what ``torchrun -m ddpkit`` runs on every rank)."""

from .cli import entry

if __name__ == "__main__":
    entry()
