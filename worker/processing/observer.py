"""What a pass tells its observer, for metrics (design §7); the pass itself imports none.

The worker's Prometheus counters (`worker.metrics.TaskMetrics`) implement `PassObserver`;
a pass given no observer reports to `NoopObserver`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class PassObserver(Protocol):
    """Receives what a pass did. Methods must not raise."""

    def claimed(self, n: int) -> None:
        """`n` tasks were claimed."""

    def claim_seconds(self, seconds: float) -> None:
        """The claim transaction took `seconds`."""

    def completed(self, task_type: str, seconds: Sequence[float]) -> None:
        """`len(seconds)` tasks of `task_type` completed; each handler ran that long.

        Called once per flush of completions and task type, not once per task.
        """

    def retried(self, task_type: str, seconds: float | None = None) -> None:
        """An attempt failed and the task was scheduled again."""

    def failed(self, task_type: str, seconds: float | None = None) -> None:
        """A task failed for good (`seconds` None when no handler ran)."""

    def released(self, n: int) -> None:
        """`n` claimed tasks were handed back unstarted."""

    def lease_lost(self, n: int = 1) -> None:
        """`n` fenced statements matched nothing: the lease had been taken over."""


class NoopObserver:
    """A `PassObserver` that records nothing."""

    def claimed(self, n: int) -> None:
        """Ignore."""

    def claim_seconds(self, seconds: float) -> None:
        """Ignore."""

    def completed(self, task_type: str, seconds: Sequence[float]) -> None:
        """Ignore."""

    def retried(self, task_type: str, seconds: float | None = None) -> None:
        """Ignore."""

    def failed(self, task_type: str, seconds: float | None = None) -> None:
        """Ignore."""

    def released(self, n: int) -> None:
        """Ignore."""

    def lease_lost(self, n: int = 1) -> None:
        """Ignore."""
