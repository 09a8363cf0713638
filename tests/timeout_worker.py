"""`python -m worker`, with the task types of the timeout tests (`tests/test_timeouts.py`).

Run as `python -m tests.timeout_worker [worker flags]`: the registry gets the types below, and
the supervisor's forked children inherit it. Each ignores its deadline on its first attempt
and returns `{"attempt": n}` on later ones.

- `block_in_c`: blocks in C code that nothing interrupts, the GIL released, as a native
  library's deadlock would: it locks a pthread mutex it already holds.
- `spin`: a Python loop that never ends and never looks at its deadline.
- `hold_gil`: sleeps 30 s in C holding the GIL, as a runaway extension would: every thread of
  its process stops, the lease keeper's and the alive signal's included.
"""

from __future__ import annotations

import ctypes
import sys

from worker import cli, tasktypes
from worker.tasktypes.base import TaskContext, TaskType
from worker.tasktypes.noop import NoopPayload


def block_in_c(task: TaskContext) -> dict[str, int]:
    """Deadlock on the first attempt (see the module docstring); return on later ones."""
    if task.attempt == 1:
        libc = ctypes.CDLL(None)  # ctypes releases the GIL around the call
        # All zeros is glibc's PTHREAD_MUTEX_INITIALIZER: a normal mutex, which a second
        # lock by its holder waits for forever (a futex wait, resumed after any signal).
        mutex = ctypes.create_string_buffer(64)
        libc.pthread_mutex_lock(mutex)
        libc.pthread_mutex_lock(mutex)
    return {"attempt": task.attempt}


def spin(task: TaskContext) -> dict[str, int]:
    """Loop forever in Python on the first attempt; return on later ones."""
    n = 0
    while task.attempt == 1:
        n += 1
    return {"attempt": task.attempt}


def hold_gil(task: TaskContext) -> dict[str, int]:
    """Sleep 30 s in C holding the GIL on the first attempt; return on later ones."""
    if task.attempt == 1:
        ctypes.PyDLL(None).sleep(30)  # a PyDLL call keeps the GIL
    return {"attempt": task.attempt}


TYPES = (
    TaskType("block_in_c", "Blocks in C on its first attempt.", NoopPayload, block_in_c),
    TaskType("spin", "Loops in Python on its first attempt.", NoopPayload, spin),
    TaskType("hold_gil", "Holds the GIL in C on its first attempt.", NoopPayload, hold_gil),
)

if __name__ == "__main__":
    tasktypes.REGISTRY.update((t.name, t) for t in TYPES)
    sys.exit(cli.main())
