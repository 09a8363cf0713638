"""This process as a holder of leases: its `workers` row and its heartbeat (decision 0010).

A worker child keeps one `Holder` for its life and its liveness thread beats it
(`worker.liveness`); a pass given none (`--once`, `POST /workers/process`) registers one for
the pass and its lease keeper beats it. The sweep (`sweep`) takes back every lease of a holder
whose heartbeat is older than the stale window, and deletes its row: the next beat finds the
row gone, and the holder's passes start none of the tasks they hold (`ProcessingPass`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg

from db import workers

T = TypeVar("T")
# Runs one statement on a connection, committed; raises `DBAPIError`.
Write = Callable[[Callable[[psycopg.Connection[Any]], T]], T]

log = logging.getLogger("fairq.worker.holder")


class Holder:
    """A registered worker: its id (`locked_by` of its leases), and what its beats found.

    `confirmed_at` (`time.monotonic()` before the last beat that found the row was sent):
    until `confirmed_at + stale_after` no sweep takes its leases. `generation` grows each
    time a beat found the row gone: every lease taken before then is lost. Beats come from
    several threads (the liveness thread, a pass confirming before a task): one at a time.
    """

    def __init__(self, worker_id: str, *, host: str, pid: int, write: Write[Any]) -> None:
        self.worker_id = worker_id
        self.host = host
        self.pid = pid
        self._write = write
        self._lock = threading.Lock()
        self.confirmed_at = float("-inf")
        self.generation = 0
        self._retired = False  # its row deleted for good: beats no longer register it again

    def register(self) -> None:
        """Store the row; raise `DBAPIError` if the database refuses."""
        with self._lock:
            sent_at = time.monotonic()
            self._write(
                lambda conn: workers.register(conn, self.worker_id, host=self.host, pid=self.pid)
            )
            self.confirmed_at = sent_at

    def beat(self) -> None:
        """Refresh the row's heartbeat; if it was gone, count the leases lost and register again."""
        with self._lock:
            if self._retired:
                return
            sent_at = time.monotonic()
            if not self._write(lambda conn: workers.heartbeat(conn, self.worker_id)):
                self.generation += 1
                log.warning(
                    "worker %s was found dead by a sweep (no heartbeat for the stale window); "
                    "its leases were taken back: registering again",
                    self.worker_id,
                    extra={"event": "worker.declared_dead", "worker_id": self.worker_id},
                )
                self._write(
                    lambda conn: workers.register(
                        conn, self.worker_id, host=self.host, pid=self.pid
                    )
                )
            self.confirmed_at = sent_at

    def deregister(self, write: Write[Any] | None = None) -> None:
        """Delete the row for good (a clean exit: it holds no lease); no beat writes it again.

        `write`: run the statement with it rather than the holder's own (a lease keeper's
        connection, when the process is about to exit: `ProcessingPass`).
        """
        with self._lock:
            (write or self._write)(lambda conn: workers.deregister(conn, self.worker_id))
            self._retired = True
