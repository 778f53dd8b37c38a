"""Who else uses this machine's CPUs while ddpkit measures: other processes' CPU time, from /proc.

    before = others()                                  # {pid: CPU seconds} outside this process's tree
    ... run ...
    cores = busy_cores(before, others(), wall_s)       # cores' worth of CPU the others took meanwhile

``bench`` reads it before and during every run: a world-1 run whose threads share the cores
with a busy process collapses (a plain torch step: 79 ms on 1 thread, 417 ms on 2 under one
busy loop on 2 cores), and every speedup measured against it is then fiction (7.63x, 381%).
The load average (``doctor``) counts this process's own threads too and lags by a minute; the
CPU seconds of processes outside this one's tree are what the measured runs competed with.
Linux only (``/proc``); elsewhere None: not measured.
"""

from __future__ import annotations

import os
import time

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # /proc/<pid>/stat's unit, per second


def _stat(pid: str) -> tuple[int, float] | None:
    """(parent pid, CPU seconds used: user + system) of ``pid``, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            text = fh.read().decode(errors="replace")
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # after "pid (comm) ": comm may hold spaces and ')'
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK  # ppid, utime + stime


def others() -> dict[int, float] | None:
    """CPU seconds of every process that is not this one or its descendants (its workers, their
    data loaders, a forkserver); None without /proc."""
    if not os.path.isdir("/proc/self"):
        return None
    stats = {int(p): s for p in os.listdir("/proc") if p.isdecimal() and (s := _stat(p)) is not None}
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    ours, todo = set(), [os.getpid()]
    while todo:
        pid = todo.pop()
        ours.add(pid)
        todo.extend(children.get(pid, []))
    return {pid: cpu for pid, (_, cpu) in stats.items() if pid not in ours}


def busy_cores(before: dict[int, float] | None, after: dict[int, float] | None, wall_s: float) -> float | None:
    """Cores' worth of CPU that other processes used between two :func:`others` readings ``wall_s``
    apart. One that started in between counts whole; one that ended in between is not seen."""
    if before is None or after is None or wall_s <= 0:
        return None
    used = sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())
    return max(0.0, used) / wall_s


def sample(seconds: float = 0.5) -> float | None:
    """Cores' worth of CPU that other processes use now, over ``seconds``."""
    before, t = others(), time.perf_counter()
    time.sleep(seconds)
    return busy_cores(before, others(), time.perf_counter() - t)
