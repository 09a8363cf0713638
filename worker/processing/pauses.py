"""Whether a batch's companies are paused, as read at most `PAUSE_SEEN_WITHIN_SECONDS` ago.

A pass checks before it starts each task (design §4 "Pause"): a task of a company paused since
the claim is handed back unstarted, its attempt not counted. The claim itself took no paused
company's task, so what it returned stands as a read made when it was sent; the lease keeper
reads again while the batch runs, and a task that finds the last read too old reads once more
itself before it starts (the common case: a batch that starts tasks reads once per
`TRUSTED_FOR_SECONDS`).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterable

from db import workers
from worker.processing.database import PassDatabase

# A read is trusted this long: a fifth of the pause's wait is left for the moments between a
# task's check and its handler's start (another thread may hold the GIL).
TRUSTED_FOR_SECONDS = workers.PAUSE_SEEN_WITHIN_SECONDS * 0.8
# The lease keeper reads again once the last read is this old: for a batch whose handlers
# run long and start no task, so that a pause hands its tasks back without waiting for one.
# A batch that starts tasks often reads before a start, once per `TRUSTED_FOR_SECONDS` (a
# keeper reading ahead of them would read more often: 0.34 commits a task instead of 0.14 on
# a drain of 0.5 s tasks on 16 threads, decision 0010).
REFRESH_AFTER_SECONDS = TRUSTED_FOR_SECONDS * 2


class BatchPauses:
    """The paused companies among a batch's, and when that was read (`time.monotonic()`).

    Shared by the pass's threads and its lease keeper: a read replaces both attributes at
    once (one tuple store), so a reader never pairs an old set with a new time.
    """

    def __init__(self) -> None:
        self._companies: frozenset[uuid.UUID] = frozenset()
        # (paused companies, monotonic time before the read that found them was sent)
        self._seen: tuple[frozenset[uuid.UUID], float] = (frozenset(), float("-inf"))
        self._lock = threading.Lock()  # one read at a time; the answer's order kept

    def claimed(self, company_ids: Iterable[uuid.UUID], sent_at: float) -> None:
        """A batch of these companies was claimed by a statement sent at `sent_at`.

        The claim skips paused companies, and a pause waits for the claims in flight to
        commit (`db.companies.pause_company`): none of them was paused when it was sent.
        """
        self._companies = frozenset(company_ids)
        self._seen = (frozenset(), sent_at)

    @property
    def seen_paused(self) -> frozenset[uuid.UUID]:
        """The batch's companies the last read found paused."""
        return self._seen[0]

    def refresh(self, db: PassDatabase) -> None:
        """For the lease keeper: read again if the last read is `REFRESH_AFTER_SECONDS` old."""
        if self._companies:
            self._read_if_older(REFRESH_AFTER_SECONDS, db)

    def _read_if_older(self, age: float, db: PassDatabase) -> None:
        """Read which of the batch's companies are paused now, unless another thread just did."""
        with self._lock:
            sent_at = time.monotonic()
            if sent_at - self._seen[1] < age:
                return
            companies = self._companies
            paused = db.write(lambda conn: workers.paused_companies(conn, companies))
            self._seen = (frozenset(paused), sent_at)

    def paused(self, company_id: uuid.UUID, db: PassDatabase) -> bool:
        """Whether a task of `company_id` must not start: its company is paused.

        Reads first if the last read is older than `TRUSTED_FOR_SECONDS`; a database error
        propagates (the task is then not started).
        """
        if time.monotonic() - self._seen[1] >= TRUSTED_FOR_SECONDS:
            self._read_if_older(TRUSTED_FOR_SECONDS, db)
        return company_id in self._seen[0]
