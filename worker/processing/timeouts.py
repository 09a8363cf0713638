"""Per-task timeouts (design §4, Timeouts): each attempt's deadline, and what happens past it.

One mechanism: a task's deadline. Every attempt runs under its task's `timeout_seconds`;
the handler is given its deadline (`TaskContext.deadline`), and the built-in
ones end by it themselves (`sleep` waits until then at most, `webhook` and `send_email`
bound their I/O by it: design §6). A handler that has not returned `OVERRUN_GRACE_SECONDS`
after its deadline has overrun: the pass's lease keeper, whose thread wakes every few tens of
milliseconds anyway, writes that task's timeout outcome (retry with backoff, or failure once
attempts are used up: fenced by the lease token, the attempt counted), hands back the batch's
unstarted tasks, and starts no other task; once the pass's other running handlers have
returned or overrun too, a worker child exits and its supervisor replaces it, as gunicorn
ends a worker past its timeout: a thread running Python code it never leaves, or blocked in
C code, is freed only by ending its process.

A child that cannot even do that (C code holding the GIL stops every thread of it) stops its
alive signal too: the supervisor kills it as hung (`WORKER_CHILD_TIMEOUT_SECONDS`, design
§5), and the sweep takes its leases back once its `workers` row is stale.

Nothing is raised inside a handler from outside: no asynchronous exception, no signal
(docs/decisions/0013).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from db import claims

# How long after its deadline a handler may still return before it has overrun: enough for
# one that honours its deadline to return (a webhook's sockets shut at it, then unwound), and
# for a cleanup; well below the stale window.
OVERRUN_GRACE_SECONDS = 5.0


class Running(NamedTuple):
    """A handler's call: its task, timeout (s) and start (`time.monotonic()`)."""

    task: claims.ClaimedTask
    timeout: float
    started: float

    @property
    def deadline(self) -> float:
        """When its timeout is up, in `time.monotonic()` seconds."""
        return self.started + self.timeout

    @property
    def overrun_at(self) -> float:
        """When it has overrun, if still running: its deadline plus the grace."""
        return self.started + self.timeout + OVERRUN_GRACE_SECONDS


@dataclass(frozen=True)
class Overrun:
    """A handler still running `ran` seconds after it started, its `timeout` and the grace
    past. The pass wrote its task's timeout outcome and what else it owed (`overruns`)."""

    task: claims.ClaimedTask
    timeout: float
    ran: float
