"""``python -m slow_rank0 ARGS``: the ddpkit CLI, with global rank 0 starting 2 s late (tests only).

Under torchrun the ranks reach a bad flag at about the same time; on a loaded machine rank 0 can be
the slow one, and torchrun stops every rank as soon as the first one exits.
"""

import os
import time

from ddpkit.cli import entry

if os.environ.get("RANK") == "0":
    time.sleep(2)
entry()
