"""What a pass did, in tasks: its result, and the counter that adds it up while it runs."""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class PassResult:
    """What one pass did; the body of `POST /workers/process`.

    `failed` includes poison pills the sweep failed before the claim; `lease_lost` counts
    tasks whose finalization (or start) found the lease taken over.
    """

    claimed: int = 0
    completed: int = 0
    retried: int = 0
    failed: int = 0
    released: int = 0
    lease_lost: int = 0

    def __add__(self, other: PassResult) -> PassResult:
        return PassResult(
            self.claimed + other.claimed,
            self.completed + other.completed,
            self.retried + other.retried,
            self.failed + other.failed,
            self.released + other.released,
            self.lease_lost + other.lease_lost,
        )


class ResultCounter:
    """The result of a pass so far, added to by the pass and by its lease keeper."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._result = PassResult()

    def add(self, counts: PassResult) -> None:
        """Add `counts` (e.g. `PassResult(failed=1)`) to the result."""
        with self._lock:
            self._result += counts

    def result(self) -> PassResult:
        """The result so far."""
        return self._result
