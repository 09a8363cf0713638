"""Runner threads: where a pass runs its batch's handlers besides its own thread.

A pass with `threads` N (`WORKER_THREADS`) runs up to N handlers of its batch at once: its own
thread and N - 1 runner threads each take the batch's next task, in claim order, until none is
left or the pass stops (`one_pass.ProcessingPass`). With N = 1 there are no runner threads:
the pass's own thread runs the whole batch, one task after another.

A worker child keeps one `Runners` for its life, as it keeps one lease keeper: threads started
and joined per batch would cost more than a batch of noop handlers (docs/decisions/0003). A
pass given none starts its own for that pass, when its batch has more than one task.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from queue import SimpleQueue

# Work for a runner thread, and the queue it reports on: None once `work` returned, else
# what it raised.
_Job = tuple[Callable[[], None], "SimpleQueue[BaseException | None]"]

# Signals a runner thread never takes: the process's stop and control signals. The kernel
# hands a process-directed signal to any thread that does not block it; CPython runs its
# Python handler on the main thread only, at its next chance, which a main thread in a long
# blocking call (a handler's) gets only once that call ends if the signal interrupted a
# runner instead. Linux prefers the main thread anyway; this makes it certain.
_BLOCKED = frozenset(
    {signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGTTIN, signal.SIGTTOU}
)


class Runners:
    """`size` threads that each run, on request, the same work as the caller's thread.

    `run` hands work to some of them and runs it on the caller's thread too; it returns once
    every one of them is done. Threads are daemons: one in a handler that overran its deadline
    (`timeouts`) never keeps a process from exiting.
    """

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"runner threads must be 0 or more, got {size}")
        self._inboxes: list[SimpleQueue[_Job | None]] = [SimpleQueue() for _ in range(size)]
        self._threads = [
            threading.Thread(
                target=self._serve, args=(inbox,), name=f"fairq-runner-{n}", daemon=True
            )
            for n, inbox in enumerate(self._inboxes, start=1)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def size(self) -> int:
        """How many runner threads there are (the caller's own not counted)."""
        return len(self._threads)

    def run(self, own: Callable[[], None], other: Callable[[], None], helpers: int) -> None:
        """Call `own` on this thread and `other` on `helpers` runner threads; wait for all.

        `helpers` is at most `size`. Whatever any of them raises is raised here once all are
        done: this thread's exception first, else the first runner's to report.
        """
        if not 0 <= helpers <= len(self._inboxes):
            raise ValueError(f"{helpers} helpers asked of {len(self._inboxes)} runner threads")
        # A queue per call: a call cut short while waiting (an exception raised in the wait
        # itself) leaves its late reports there, not in the next call's.
        done: SimpleQueue[BaseException | None] = SimpleQueue()
        for inbox in self._inboxes[:helpers]:
            inbox.put((other, done))
        try:
            own()
        finally:
            # Also when `own` raised: the runners' tasks finish before the pass goes on.
            reports = [done.get() for _ in range(helpers)]
        raised = next((exc for exc in reports if exc is not None), None)
        if raised is not None:
            raise raised

    def close(self) -> None:
        """Stop the threads once idle, and wait for them."""
        for inbox in self._inboxes:
            inbox.put(None)
        for thread in self._threads:
            thread.join()

    @staticmethod
    def _serve(inbox: SimpleQueue[_Job | None]) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, _BLOCKED)
        while (job := inbox.get()) is not None:
            work, done = job
            try:
                work()
            except BaseException as exc:  # reported to the caller, which raises it
                done.put(exc)
            else:
                done.put(None)
