"""One forked worker child as its supervisor sees it: its pid, pipes, and what it reported.

`worker.supervisor` keeps one `ChildProcess` per child it forked. The child writes to two
pipes whose read ends are here (non-blocking): its status pipe (a line when it booted, or
why it could not; the task a handler overran) and its alive pipe (a byte a second while
alive, `worker.liveness.AliveSignal`). Design §5.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from worker import child

# The most of a child's status pipe kept: its lines are short, and a child cannot make the
# supervisor hold more.
MAX_STATUS_BYTES = 4096


@dataclass
class ChildProcess:
    """What the supervisor knows about one forked child.

    `started_at` is monotonic; `generation` is the HUP generation it was spawned in;
    `status_fd` and `alive_fd` are the read ends of its status and alive pipes (-1 once
    closed); `alive_at` (monotonic) is when it last said it was alive.
    """

    pid: int
    started_at: float
    generation: int
    status_fd: int
    alive_fd: int = -1
    alive_at: float = 0.0
    status: bytes = b""
    booted: bool = False
    retiring: bool = False
    kill_at: float | None = None
    killed: bool = False
    hung: bool = False

    @property
    def boot_error(self) -> str:
        """The reason the child sent before exiting with `child.BOOT_ERROR`, if any."""
        return self._reported(child.STATUS_ERROR)

    @property
    def stuck_handler(self) -> str:
        """What the child said before exiting with `child.HANDLER_STUCK`, if anything."""
        return self._reported(child.STATUS_STUCK)

    def _reported(self, prefix: str) -> str:
        for line in self.status.decode("utf-8", "replace").splitlines():
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
        return "no reason given (see the child's log above)"

    def read_status(self) -> bool:
        """Read what the child wrote on its status pipe; tell whether it just said it booted."""
        if self.status_fd < 0:
            return False
        was_booted = self.booted
        while True:
            try:
                data = os.read(self.status_fd, MAX_STATUS_BYTES)
            except (BlockingIOError, InterruptedError):
                break
            if not data:
                self._close_status()
                break
            self.status += data[: MAX_STATUS_BYTES - len(self.status)]
            if not self.booted and child.STATUS_BOOTED.encode() in self.status:
                self.booted = True
        return self.booted and not was_booted

    def drain_alive(self) -> bool:
        """Read what the child wrote on its alive pipe; tell whether it wrote anything."""
        alive = False
        while self.alive_fd >= 0:
            try:
                data = os.read(self.alive_fd, MAX_STATUS_BYTES)
            except (BlockingIOError, InterruptedError):
                break
            if not data:  # the child closed it (exiting): the reap decides what that means
                break
            alive = True
        return alive

    def close_pipes(self) -> None:
        """Close the supervisor's ends of the child's status and alive pipes."""
        self._close_status()
        if self.alive_fd >= 0:
            os.close(self.alive_fd)
            self.alive_fd = -1

    def _close_status(self) -> None:
        if self.status_fd >= 0:
            os.close(self.status_fd)
            self.status_fd = -1

    def describe_exit(self, status: int) -> tuple[int | None, str]:
        """The exit code (None if killed by a signal) and how to say it in the log."""
        if os.WIFEXITED(status):
            code = os.WEXITSTATUS(status)
            return code, f"exit status {code}"
        sig = os.WTERMSIG(status)
        how = f"killed by {signal.Signals(sig).name}"
        if sig == signal.SIGKILL and not self.killed:
            # We send SIGKILL only to hung, overdue or leftover children; anyone else's is
            # almost always the kernel's out-of-memory killer.
            how += " (likely out of memory: the OOM killer sends SIGKILL)"
        return None, how
