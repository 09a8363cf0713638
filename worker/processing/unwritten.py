"""Outcomes a database error kept a pass from writing, kept for the next pass to write.

Dropped, the tasks would wait out their leases and run again. A caller that runs pass after
pass (a worker child, `--once`) hands each the same `UnwrittenOutcomes`: a pass writes what it
holds (fenced, so writing twice is harmless) before it claims anything.
"""

from __future__ import annotations

from collections.abc import Sequence

from db import claims
from worker.processing.completer import Completion


class UnwrittenOutcomes:
    """Completions and releases that passes ending on a database error could not write.

    Not thread-safe: one caller (a worker child's loop) hands it to each of its passes in turn.
    """

    def __init__(self) -> None:
        self._completions: list[Completion] = []
        self._releases: list[claims.ClaimedTask] = []

    @property
    def completions(self) -> int:
        """Tasks that ran to success whose completion is not written yet."""
        return len(self._completions)

    @property
    def releases(self) -> int:
        """Claimed tasks that never started and are not handed back yet."""
        return len(self._releases)

    def __bool__(self) -> bool:
        return bool(self._completions or self._releases)

    def keep(
        self, completions: Sequence[Completion], releases: Sequence[claims.ClaimedTask]
    ) -> None:
        """Keep these until a pass takes them."""
        self._completions.extend(completions)
        self._releases.extend(releases)

    def take(self) -> tuple[list[Completion], list[claims.ClaimedTask]]:
        """Everything kept, (completions, releases); the pass keeps what it cannot write."""
        taken = self._completions, self._releases
        self._completions, self._releases = [], []
        return taken
