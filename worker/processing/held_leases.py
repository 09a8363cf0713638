"""The leases a pass holds.

Shared by the pass and its lease keeper thread: every method is atomic. A lease is held from
the claim until its task's outcome is written; it stays alive while its holder's heartbeat
does (`holder`).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterable

from db import claims


class HeldLeases:
    """The leases of the tasks a pass holds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[uuid.UUID, claims.Held] = {}

    def hold(self, tasks: Iterable[claims.Held]) -> None:
        """Hold the leases of `tasks` too (claimed, or kept unwritten by an earlier pass)."""
        with self._lock:
            self._held.update((task.id, task) for task in tasks)

    def let_go(self, task_ids: Iterable[uuid.UUID]) -> None:
        """Stop holding these tasks' leases: their outcome is written (or was refused)."""
        with self._lock:
            for task_id in task_ids:
                self._held.pop(task_id, None)

    def __len__(self) -> int:
        """How many leases are held."""
        with self._lock:
            return len(self._held)

    def holds(self, task_id: uuid.UUID) -> bool:
        """Whether the lease of `task_id` is still held."""
        with self._lock:
            return task_id in self._held
