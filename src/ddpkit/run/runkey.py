"""What a snapshot is matched on: the run key, a small protocol every face's config meets.

A snapshot records its run's key (``to_dict()`` and ``hash()``). A later run resumes it only where its
own key agrees: ``differing_keys`` names what does not, in the user's words, and ``world_change`` says
why a snapshot cannot be resumed at another world size ("" where it can). ``TrainConfig`` is the
``Trainer``'s and the CLI's key (``config.py``); :class:`CodeKey` is ``Loop``'s: some fields of its
config, and the code of the loop.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from typing import Any, Protocol

from .rundir import describe_difference


class RunKey(Protocol):
    def to_dict(self) -> dict:
        """The whole config, as a snapshot and the run dir record it."""

    def hash(self) -> str:
        """A short digest of what a snapshot is matched on."""

    def differing_keys(self, other: dict) -> list[str]:
        """What differs from a snapshot's ``to_dict()``, in words; [] when it may be resumed."""

    def world_change(self, old_world: int, new_world: int) -> str:
        """Why a snapshot made at ``old_world`` cannot resume at ``new_world``, in one line; "" if it can."""


class CodeKey:
    """A ``Loop``'s key: the ``hashed`` fields of its frozen config, and (unless ``check_code`` is off) the
    code of the loop as ``identity.code_fingerprint`` read it."""

    def __init__(self, config: Any, code: dict, hashed: tuple[str, ...], check_code: bool = True):
        self.config, self.code, self.hashed, self.check_code = config, code, hashed, check_code

    def to_dict(self) -> dict:
        return {**asdict(self.config), "code": self.code}

    def _keyed(self, d: dict) -> dict:
        keyed = {k: d.get(k) for k in self.hashed}
        if self.check_code:
            keyed["code"] = d.get("code")
        return keyed

    def hash(self) -> str:
        return hashlib.sha256(json.dumps(self._keyed(self.to_dict()), sort_keys=True).encode()).hexdigest()[:16]

    def differing_keys(self, other: dict) -> list[str]:
        """The loop's code differs by the parts that differ, as Trainer's identity names them (``global
        learning_rate 0.0006 -> 0.001``). The code compares on what was read: a snapshot whose code was not
        read (an older ddpkit's Loop made at a script's top level) matches on the rest, as it did then."""
        mine, theirs = self._keyed(self.to_dict()), self._keyed(other)
        keys = [k for k in mine if k != "code" and mine[k] != theirs.get(k)]
        now, before = mine.get("code") or {}, theirs.get("code") or {}
        if "code" in mine and before.get("parts") and now.get("parts") != before.get("parts"):
            key = "the loop's code in"  # said as "the loop's code in train.py: global learning_rate 0.0006 -> 0.001"
            said = describe_difference(key, None, None, {key: before}, {key: now})
            keys.append(f"{said} (Loop(check_code=False) resumes anyway)")
        return keys

    def world_change(self, old_world: int, new_world: int) -> str:
        return ""  # a Loop's data split and per-rank state are remapped (loop.py, Loop._load)
