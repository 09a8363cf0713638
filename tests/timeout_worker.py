"""`python -m worker`, with the task types of the timeout tests (`tests/test_timeouts.py`).

Run as `python -m tests.timeout_worker [worker flags]`: the registry gets the types below, and
the supervisor's forked children inherit it.

- `block_in_c`: its first attempt blocks in C code that neither an exception nor a signal
  interrupts, the GIL released, as a native library's deadlock would: it locks a pthread
  mutex it already holds. Later attempts return `{"attempt": n}`.
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


TYPES = (TaskType("block_in_c", "Blocks in C on its first attempt.", NoopPayload, block_in_c),)

if __name__ == "__main__":
    tasktypes.REGISTRY.update((t.name, t) for t in TYPES)
    sys.exit(cli.main())
