"""Completions waiting to be written together: one fenced statement per flush, not per task."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import NamedTuple

from db import queue

# A completion waits at most about this long (plus one lease keeper tick) before it is
# written: writing them together cuts commits per task, waiting longer would only delay
# their visibility.
FLUSH_AFTER_SECONDS = 0.1


class Completion(NamedTuple):
    """A task whose handler returned, not yet written as completed."""

    task: queue.ClaimedTask
    lease: queue.Lease
    seconds: float  # how long the handler ran
    at: float  # time.monotonic() when it returned
    result: str | None = None  # what it returned, as JSON text (`task_result.encode`)


class CompletionBuffer:
    """Completions not yet written, oldest first; shared by the pass and its lease keeper."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[Completion] = []

    def append(self, completion: Completion) -> None:
        """Buffer `completion`, after those already waiting."""
        with self._lock:
            self._items.append(completion)

    def extend(self, completions: Iterable[Completion]) -> None:
        """Buffer `completions`, after those already waiting."""
        with self._lock:
            self._items.extend(completions)

    def put_back(self, completions: list[Completion]) -> None:
        """Return completions whose write failed, to the front: they stay oldest."""
        with self._lock:
            self._items[:0] = completions

    def take(self, *, force: bool = True) -> list[Completion]:
        """Take every buffered completion; unless `force`, only once the oldest is due."""
        with self._lock:
            if not self._items:
                return []
            if not force and time.monotonic() - self._items[0].at < FLUSH_AFTER_SECONDS:
                return []
            taken, self._items = self._items, []
        return taken
