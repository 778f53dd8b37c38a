"""``python -m ddpkit ...`` (also what ``torchrun -m ddpkit`` runs on every rank)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
