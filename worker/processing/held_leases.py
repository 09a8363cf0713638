"""The leases a pass holds, which of them were found taken over, and their heartbeat.

Shared by the pass and its lease keeper thread: every method is atomic. A lease is held from
the claim until its task's outcome is written, and refreshed by `heartbeat` meanwhile.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterable, Sequence

from db import queue
from worker.processing.database import PassDatabase
from worker.processing.task_log import log


class HeldLeases:
    """The leases of the tasks a pass holds, and the ones found taken over meanwhile."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[uuid.UUID, queue.Lease] = {}
        self._lost: set[uuid.UUID] = set()
        # time.monotonic() when every held lease was last confirmed (claim or heartbeat).
        self.confirmed_at = 0.0

    def hold(self, leases: Iterable[queue.Lease]) -> None:
        """Hold `leases` too (claimed, or kept unwritten by an earlier pass)."""
        with self._lock:
            self._held.update((lease.task_id, lease) for lease in leases)

    def let_go(self, task_ids: Iterable[uuid.UUID]) -> None:
        """Stop holding these tasks' leases: their outcome is written (or was refused)."""
        with self._lock:
            for task_id in task_ids:
                self._held.pop(task_id, None)

    def holds(self, task_id: uuid.UUID) -> bool:
        """Whether the lease of `task_id` is still held."""
        with self._lock:
            return task_id in self._held

    @property
    def any_lost(self) -> bool:
        """Whether any lease was found taken over (a cheap look before `take_lost`)."""
        return bool(self._lost)  # a set's truth value needs no lock

    def take_lost(self, task_id: uuid.UUID) -> bool:
        """If `task_id`'s lease was found taken over, let it go and say so."""
        with self._lock:
            if task_id not in self._lost:
                return False
            self._lost.discard(task_id)
            self._held.pop(task_id, None)
        return True

    def split_lost(
        self, tasks: Sequence[queue.ClaimedTask]
    ) -> tuple[list[queue.ClaimedTask], list[queue.ClaimedTask]]:
        """Of `tasks`, (those found taken over, now let go; those still held)."""
        with self._lock:
            lost = [t for t in tasks if t.id in self._held and t.id in self._lost]
            for task in lost:
                self._lost.discard(task.id)
                self._held.pop(task.id, None)
            return lost, [t for t in tasks if t.id in self._held]

    def heartbeat(self, db: PassDatabase) -> None:
        """Refresh every held lease; remember the ones found taken over."""
        with self._lock:
            leases = list(self._held.values())
        if not leases:
            return
        leased_at = time.monotonic()
        refreshed = db.write(lambda conn: queue.heartbeat(conn, leases))
        self.confirmed_at = leased_at
        lost = {lease.task_id for lease in leases} - refreshed
        if lost:
            log.warning(
                "%d of %d leases were taken over before their heartbeat", len(lost), len(leases)
            )
            with self._lock:
                # Still held means not finalized meanwhile: really lost, not just done.
                self._lost |= {task_id for task_id in lost if task_id in self._held}
