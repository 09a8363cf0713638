"""Pausing and resuming a company (`db.companies.pause_company` / `resume_company`).

What must hold: a paused company's tasks are accepted and kept but never claimed, while the
claim still fills its batches from the other companies (work-conserving); its running tasks
heartbeat and finish as usual, and a task it gets back (retry with backoff, release, lost
lease, an API retry) waits; once the pause has committed no claim takes its tasks, not even
the claim that read the ring just before it; resuming makes its runnable work claimable
again through the claim's promotion, longest runnable first, taking turns level with the
others; and the claim's cost does not grow with paused companies.
"""

from __future__ import annotations

import collections
import datetime as dt
import itertools
import random
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, pool, text
from sqlalchemy.orm import Session, sessionmaker

from db import claims, companies, errors, queue
from db.engine import driver_connection, make_engine, make_sessionmaker
from tests.factories import (
    MakeCompany,
    insert_companies_with_tasks,
    insert_company,
    insert_task,
    insert_tasks,
    take_back,
)
from tests.supervisor_harness import wait_for


def claim(session: Session, batch_size: int = 100) -> list[claims.ClaimedTask]:
    """Claim a batch as a worker does, and commit."""
    batch = claims.claim(
        driver_connection(session, transaction=False), worker_id="pause:1", batch_size=batch_size
    )
    session.commit()
    return batch


def of(batch: Sequence[claims.ClaimedTask], company_id: uuid.UUID) -> list[uuid.UUID]:
    """The ids of `company_id`'s tasks in `batch`, in claim order."""
    return [task.id for task in batch if task.company_id == company_id]


def pause(session: Session, company_id: uuid.UUID) -> None:
    """Pause the company and commit, as the API does."""
    companies.pause_company(driver_connection(session, transaction=False), company_id)
    session.commit()


def resume(session: Session, company_id: uuid.UUID) -> None:
    """Resume the company and commit, as the API does."""
    companies.resume_company(driver_connection(session, transaction=False), company_id)
    session.commit()


@dataclass(frozen=True)
class QueueRow:
    """The claim's view of a company (`company_queues`), and its earliest pending task."""

    due_at: dt.datetime | None
    ready: bool
    paused: bool
    earliest_pending: dt.datetime | None


def queue_row(session: Session, company_id: uuid.UUID) -> QueueRow:
    """The company's `company_queues` row, read fresh."""
    row = session.execute(
        text(
            "SELECT q.due_at, q.ready, q.paused, "
            "(SELECT min(t.run_after) FROM tasks t "
            " WHERE t.company_id = q.company_id AND t.status = 'pending') AS earliest "
            "FROM company_queues q WHERE q.company_id = :c"
        ),
        {"c": company_id},
    ).one()
    return QueueRow(row.due_at, row.ready, row.paused, row.earliest)


def assert_wakes_up_on_resume(session: Session, company_id: uuid.UUID) -> None:
    """The wake-up invariant held through the pause (design §4, "The wake-up protocol").

    `due_at` is a lower bound of the earliest pending `run_after` (so the promotion finds
    the company once resumed), and a paused company is out of the ring.
    """
    row = queue_row(session, company_id)
    if row.earliest_pending is not None:
        assert row.due_at is not None, row
        assert row.due_at <= row.earliest_pending, row
    if row.paused:
        assert not row.ready, row


def claimed_so_far(session: Session, company_id: uuid.UUID) -> set[uuid.UUID]:
    """The company's tasks any claim ever took (`started_at` is set by the first one)."""
    return set(
        session.execute(
            text("SELECT id FROM tasks WHERE company_id = :c AND started_at IS NOT NULL"),
            {"c": company_id},
        ).scalars()
    )


def pending_count(session: Session, company_id: uuid.UUID) -> int:
    """How many of the company's tasks are pending."""
    count: int = session.execute(
        text("SELECT count(*) FROM tasks WHERE company_id = :c AND status = 'pending'"),
        {"c": company_id},
    ).scalar_one()
    return count


# -- paused: kept, never claimed; the others fill the batch ----------------------------------


@pytest.mark.parametrize("when", ["waiting", "in-the-ring"])
def test_a_paused_companys_tasks_are_never_claimed_while_the_others_fill_every_batch(
    db_session: Session, make_company: MakeCompany, when: str
) -> None:
    """Paused before its work was promoted, or while in the ring; then resumed.

    Every batch is full (work-conserving) and holds none of its tasks; after the resume the
    next batch takes its longest-waiting ones, in their order.
    """
    paused, b, c = (make_company(name).id for name in ("paused", "b", "c"))
    waiting = {company: insert_tasks(db_session, company, 60) for company in (paused, b, c)}
    if when == "in-the-ring":
        first = claim(db_session, 9)
        assert of(first, paused) == waiting[paused][:3]
        assert queue_row(db_session, paused).ready
        del waiting[paused][:3]

    pause(db_session, paused)

    assert not queue_row(db_session, paused).ready
    for _ in range(5):
        batch = claim(db_session, 10)
        assert len(batch) == 10
        assert of(batch, paused) == []
    assert pending_count(db_session, paused) == len(waiting[paused])
    assert_wakes_up_on_resume(db_session, paused)

    resume(db_session, paused)

    batch = claim(db_session, 9)
    assert of(batch, paused) == waiting[paused][:3]


def test_tasks_created_while_paused_are_kept_and_claimed_after_resume_oldest_first(
    db_session: Session, make_company: MakeCompany
) -> None:
    paused, other = make_company("paused").id, make_company("other").id
    pause(db_session, paused)
    assert queue_row(db_session, paused).due_at is None  # no work at all yet

    # The insert trigger of every create; a second older than the API's create below.
    created = insert_tasks(db_session, paused, 3, newest_age_seconds=1)
    by_api, _ = queue.create_task(
        driver_connection(db_session, transaction=False), company_id=paused, type="noop", payload={}
    )
    db_session.commit()
    theirs = insert_tasks(db_session, other, 2)

    assert [task.id for task in claim(db_session)] == theirs
    assert pending_count(db_session, paused) == 4
    assert_wakes_up_on_resume(db_session, paused)

    resume(db_session, paused)

    assert [task.id for task in claim(db_session)] == [*created, by_api.id]


def test_a_company_paused_with_only_delayed_work_is_claimed_after_resume_once_it_is_due(
    fresh_engine: Engine,
) -> None:
    """On a database of its own: due means by the clock, which a test transaction stops."""
    with make_sessionmaker(fresh_engine)() as session:
        company = insert_company(session, "later").id
        delayed = insert_task(session, company, run_after=text("now() + interval '1 second'"))
        pause(session, company)
        resume(session, company)

        assert claim(session) == []  # not due yet: resumed, but not in the ring
        assert queue_row(session, company) == QueueRow(
            delayed.run_after, False, False, delayed.run_after
        )
        deadline = time.monotonic() + 5
        while not (batch := claim(session)):
            assert time.monotonic() < deadline, "the delayed task was never claimed"
            time.sleep(0.05)
        assert [task.id for task in batch] == [delayed.id]


def test_a_resumed_company_takes_turns_level_with_the_others_banking_nothing(
    db_session: Session, make_company: MakeCompany
) -> None:
    """Five batches passed it by while paused; afterwards it gets one task a turn, no more."""
    paused, b, c = (make_company(name).id for name in ("paused", "b", "c"))
    for company in (paused, b, c):
        insert_tasks(db_session, company, 60)
    assert len(of(claim(db_session, 9), paused)) == 3  # in the ring, mid-rotation
    pause(db_session, paused)
    for _ in range(5):
        claim(db_session, 10)

    resume(db_session, paused)

    shares = collections.Counter(task.company_id for _ in range(3) for task in claim(db_session, 9))
    assert shares == {paused: 9, b: 9, c: 9}


def test_a_paused_company_found_in_the_ring_is_passed_over_however_it_got_there(
    db_session: Session, make_company: MakeCompany
) -> None:
    """The claim obeys `paused`, not only `ready`: a paused company left in the ring is not
    claimed. A claimer of an older release (during a rolling deploy) promotes companies
    without looking at `paused`, and an operator's `UPDATE companies SET paused = true`,
    which takes none of `pause_company`'s locks, can be undone by a claim's settle.
    """
    paused, other = make_company("paused").id, make_company("other").id
    waiting = insert_tasks(db_session, paused, 10)
    insert_tasks(db_session, other, 30)
    claim(db_session, 2)
    db_session.execute(text("UPDATE companies SET paused = true WHERE id = :c"), {"c": paused})
    db_session.execute(
        text("UPDATE company_queues SET ready = true WHERE company_id = :c"), {"c": paused}
    )
    db_session.commit()

    for _ in range(2):
        batch = claim(db_session, 10)
        assert len(batch) == 10
        assert of(batch, paused) == []

    resume(db_session, paused)

    assert of(claim(db_session, 10), paused) == waiting[1:6]


# -- its running tasks finish; what comes back to pending waits ------------------------------


def test_tasks_running_when_their_company_is_paused_finish_as_usual(
    db_session: Session, make_company: MakeCompany
) -> None:
    company = make_company().id
    insert_tasks(db_session, company, 2)
    done, broken = claim(db_session)

    pause(db_session, company)

    assert claims.complete_tasks(driver_connection(db_session, transaction=False), [done]) == []
    assert claims.fail_task(
        driver_connection(db_session, transaction=False),
        broken.id,
        broken.lease_token,
        error="permanent",
    )
    db_session.commit()
    statuses: dict[uuid.UUID, str] = dict(
        db_session.execute(
            text("SELECT id, status FROM tasks WHERE company_id = :c"), {"c": company}
        ).all()
    )
    assert statuses == {done.id: "completed", broken.id: "failed"}


def _retry_with_backoff(session: Session, task: claims.ClaimedTask) -> None:
    # A short backoff, waited out below: what holds the task back is the pause.
    assert claims.schedule_retry(
        driver_connection(session, transaction=False),
        task.id,
        task.lease_token,
        delay_seconds=0.05,
        error="HTTP 503",
    )


def _release(session: Session, task: claims.ClaimedTask) -> None:
    assert claims.release_tasks(driver_connection(session, transaction=False), [task]) == []


def _lose_lease(session: Session, task: claims.ClaimedTask) -> None:
    session.execute(
        text("UPDATE tasks SET locked_at = now() - interval '1 hour' WHERE id = :id"),
        {"id": task.id},
    )
    assert [lost.id for lost in take_back(session, stale_after=60)] == [task.id]


def _retry_by_api(session: Session, task: claims.ClaimedTask) -> None:
    assert claims.fail_task(
        driver_connection(session, transaction=False), task.id, task.lease_token, error="boom"
    )
    queue.retry_task(driver_connection(session, transaction=False), task.company_id, task.id)


@pytest.mark.parametrize(
    "make_pending",
    [_retry_with_backoff, _release, _lose_lease, _retry_by_api],
    ids=["retry-with-backoff", "release", "expired-lease", "api-retry"],
)
def test_a_task_made_pending_again_while_its_company_is_paused_waits_for_resume(
    fresh_engine: Engine, make_pending: Callable[[Session, claims.ClaimedTask], None]
) -> None:
    """The task was running when the pause came; it comes back to pending and stays there.

    On a database of its own: the backoff must come due by the clock.
    """
    with make_sessionmaker(fresh_engine)() as session:
        paused, other = insert_company(session, "paused").id, insert_company(session, "other").id
        insert_tasks(session, paused, 1)
        [task] = claim(session)
        pause(session, paused)

        make_pending(session, task)
        session.commit()
        time.sleep(0.1)  # the backoff is over
        theirs = insert_tasks(session, other, 1)

        assert [t.id for t in claim(session)] == theirs
        assert claim(session) == []
        assert pending_count(session, paused) == 1
        assert_wakes_up_on_resume(session, paused)

        resume(session, paused)

        assert [t.id for t in claim(session)] == [task.id]


# -- idempotence, errors ---------------------------------------------------------------------


def test_pause_and_resume_are_idempotent_and_copy_the_flag_to_the_claims_view(
    db_session: Session, make_company: MakeCompany
) -> None:
    company = make_company().id
    insert_tasks(db_session, company, 1)

    for _ in range(2):
        assert (
            companies.pause_company(
                driver_connection(db_session, transaction=False), company
            ).paused
            is True
        )
        db_session.commit()
        row = queue_row(db_session, company)
        assert (row.paused, row.ready) == (True, False)
    for _ in range(2):
        assert (
            companies.resume_company(
                driver_connection(db_session, transaction=False), company
            ).paused
            is False
        )
        db_session.commit()
        assert queue_row(db_session, company).paused is False
    assert len(claim(db_session)) == 1


def test_pausing_or_resuming_an_unknown_company_raises_not_found(db_session: Session) -> None:
    with pytest.raises(errors.NotFound):
        companies.pause_company(driver_connection(db_session, transaction=False), uuid.uuid4())
    with pytest.raises(errors.NotFound):
        companies.resume_company(driver_connection(db_session, transaction=False), uuid.uuid4())


def test_a_pause_in_autocommit_is_refused_before_it_writes(fresh_engine: Engine) -> None:
    """Each statement would commit alone: the locks would not cover the pause's commit."""
    company = insert_company(fresh_engine).id
    autocommit = fresh_engine.execution_options(isolation_level="AUTOCOMMIT")
    with Session(autocommit) as session, pytest.raises(RuntimeError, match="transaction"):
        companies.pause_company(driver_connection(session, transaction=False), company)
    with make_sessionmaker(fresh_engine)() as session:
        assert queue_row(session, company).paused is False


# -- a pause racing the claim ----------------------------------------------------------------

PAUSER = "fairq-test-pauser"


class Pausing(threading.Thread):
    """`how(session, company_id)` then commit, in a thread, on a connection named `PAUSER`."""

    def __init__(
        self,
        url: str,
        company_id: uuid.UUID,
        how: Callable[[psycopg.Connection[Any], uuid.UUID], object],
    ) -> None:
        super().__init__(daemon=True)
        self.url, self.company_id, self.how = url, company_id, how
        self.error: BaseException | None = None

    def run(self) -> None:
        engine = make_engine(self.url, application_name=PAUSER, poolclass=pool.NullPool)
        try:
            with make_sessionmaker(engine)() as session:
                self.how(driver_connection(session), self.company_id)
                session.commit()
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            engine.dispose()

    def finish(self, timeout: float = 10.0) -> None:
        """Wait for the pause to return (or fail)."""
        self.join(timeout)
        assert not self.is_alive(), "the pause never returned"


def start_pause(
    url: str, company_id: uuid.UUID, how: Callable[[psycopg.Connection[Any], uuid.UUID], object]
) -> Pausing:
    """Start `how` on the company in a thread; return at once."""
    pausing = Pausing(url, company_id, how)
    pausing.start()
    return pausing


def pauser_waits_on(engine: Engine) -> str | None:
    """What the pausing connection waits for (`advisory`, `transactionid`, ...), or None."""
    with engine.connect() as conn:
        found: str | None = conn.execute(
            text(
                "SELECT wait_event FROM pg_stat_activity "
                "WHERE application_name = :name AND wait_event_type = 'Lock'"
            ),
            {"name": PAUSER},
        ).scalar_one_or_none()
    return found


def naked_pause(conn: psycopg.Connection[Any], company_id: uuid.UUID) -> None:
    """What a pause would be without the locks: the UPDATE alone."""
    conn.execute("UPDATE companies SET paused = true WHERE id = %(id)s", {"id": company_id})


# A claim runs as one call (`fairq_claim`, db/sql/claim.sql); a test stops it at a known point
# by holding, from another session, a lock the claim waits for there:
# - the reservation (a session-level lock, "fairqrs" in ASCII): the claim holds the claims'
#   barrier (shared) and has read nothing yet;
# - the limit lock of a company with a `max_in_flight` in its batch, `(namespace,
#   hashtext(company_id) & 63)` ("fqlm"): the claim has read the ring, promoted the companies
#   that came due and moved the cursor, and claimed no task yet.
# `test_the_locks_that_stop_a_claim_are_the_ones_fairq_claim_takes` checks these numbers.
RESERVATION_LOCK_KEY = 0x66_61_69_72_71_72_73
LIMIT_LOCK_NAMESPACE = 0x66_71_6C_6D
LIMIT_LOCK_BUCKETS = 64
CLAIMER = "fairq-test-claimer"


@dataclass(frozen=True)
class AdvisoryLock:
    """An advisory lock as pg_locks names it: a bigint key, or an (int, int) pair."""

    classid: int
    objid: int
    objsubid: int

    @classmethod
    def reservation(cls) -> AdvisoryLock:
        return cls(RESERVATION_LOCK_KEY >> 32, RESERVATION_LOCK_KEY & 0xFFFF_FFFF, 1)

    @classmethod
    def limit(cls, session: Session, company_id: uuid.UUID) -> AdvisoryLock:
        bucket: int = session.execute(
            text("SELECT hashtext(CAST(:c AS text)) & (CAST(:buckets AS int) - 1)"),
            {"c": str(company_id), "buckets": LIMIT_LOCK_BUCKETS},
        ).scalar_one()
        return cls(LIMIT_LOCK_NAMESPACE, bucket, 2)

    def arguments(self) -> str:
        """The arguments of pg_advisory_lock that name this lock."""
        if self.objsubid == 1:
            return str((self.classid << 32) | self.objid)
        return f"{self.classid}, {self.objid}"


def claimer_waits_for(engine: Engine) -> AdvisoryLock | None:
    """The advisory lock the claiming connection (`CLAIMER`) waits for, or None."""
    with engine.connect() as conn:
        row = conn.execute(
            text(
                "SELECT l.classid, l.objid, l.objsubid FROM pg_locks l "
                "JOIN pg_stat_activity a ON a.pid = l.pid "
                "WHERE a.application_name = :name AND l.locktype = 'advisory' AND NOT l.granted"
            ),
            {"name": CLAIMER},
        ).one_or_none()
    return None if row is None else AdvisoryLock(*(int(value) for value in row))


# The wake-up locks a transaction holds exclusively: those a claim's settle got.
_WAKE_LOCKS_HELD = text(
    "SELECT objid FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'advisory' "
    "AND classid = CAST(:namespace AS oid) AND objsubid = 2 AND mode = 'ExclusiveLock' "
    "AND granted"
)


class Claiming(threading.Thread):
    """A claim of `batch_size`, then commit, in a thread, on a connection named `CLAIMER`.

    `batch`: what it claimed; `wake_locks`: the wake-up buckets its transaction held just
    before the commit (the settle's try-locks that succeeded).
    """

    def __init__(self, url: str, batch_size: int) -> None:
        super().__init__(daemon=True)
        self.url, self.batch_size = url, batch_size
        self.batch: list[claims.ClaimedTask] = []
        self.wake_locks: set[int] = set()
        self.error: BaseException | None = None

    def run(self) -> None:
        engine = make_engine(self.url, application_name=CLAIMER, poolclass=pool.NullPool)
        try:
            with make_sessionmaker(engine)() as session:
                batch = claims.claim(
                    driver_connection(session, transaction=False),
                    worker_id="race:1",
                    batch_size=self.batch_size,
                )
                namespace = {"namespace": claims.WAKE_LOCK_NAMESPACE}
                self.wake_locks = set(session.execute(_WAKE_LOCKS_HELD, namespace).scalars())
                session.commit()
                self.batch = batch
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            engine.dispose()

    def finish(self, timeout: float = 10.0) -> None:
        """Wait for the claim to commit; it must not have failed."""
        self.join(timeout)
        assert not self.is_alive(), "the claim never returned"
        assert self.error is None, self.error


@contextmanager
def claim_stopped_at(
    url: str, engine: Engine, lock: AdvisoryLock, batch_size: int
) -> Iterator[Claiming]:
    """Start a claim and stop it where it waits for `lock`, held here until the block ends.

    Then the claim goes on and commits before this returns.
    """
    with engine.connect() as holder:
        holder.execute(text(f"SELECT pg_advisory_lock({lock.arguments()})"))
        holder.commit()
        claiming = Claiming(url, batch_size)
        claiming.start()
        try:
            assert wait_for(lambda: claimer_waits_for(engine), 5, "the claim to wait") == lock
            yield claiming
        finally:
            holder.execute(text(f"SELECT pg_advisory_unlock({lock.arguments()})"))
            holder.commit()
    claiming.finish()


def _two_companies_with_work(
    sessions: sessionmaker[Session], *, in_ring: bool
) -> tuple[uuid.UUID, uuid.UUID, AdvisoryLock]:
    """`paused` and `other`, six tasks each, and the lock that stops a claim of both after
    it read the ring: `other`'s limit lock (a `max_in_flight` it never reaches)."""
    with sessions() as setup:
        paused, other = insert_company(setup, "paused").id, insert_company(setup, "other").id
        insert_tasks(setup, paused, 6)
        insert_tasks(setup, other, 6)
        setup.execute(
            text("UPDATE companies SET max_in_flight = 100 WHERE id = :id"), {"id": other}
        )
        setup.commit()
        if in_ring:
            assert len(claim(setup, 2)) == 2  # both promoted, one task each
        return paused, other, AdvisoryLock.limit(setup, other)


@pytest.mark.parametrize("in_ring", [True, False], ids=["in-the-ring", "promoted-by-that-claim"])
def test_a_pause_waits_for_the_claim_that_read_the_ring_before_it_and_no_later_claim_takes_a_task(
    fresh_engine: Engine, fresh_db_url: str, in_ring: bool
) -> None:
    """The claim has read the ring (the company in it) and not yet claimed when the pause comes.

    The pause returns only after that claim committed: what it took was taken before the
    pause; every claim after it passes the company over. The claim either holds the claims'
    barrier (company already in the ring) or also the company's row (it promoted it in this
    claim): the pause waits for it either way. The claim is stopped between its reading of
    the ring and its claiming by the limit lock of the other company in its batch.
    """
    sessions = make_sessionmaker(fresh_engine)
    paused, other, stop = _two_companies_with_work(sessions, in_ring=in_ring)
    with sessions() as reader:
        before = claimed_so_far(reader, paused)
    with claim_stopped_at(fresh_db_url, fresh_engine, stop, 4) as in_flight:
        pausing = start_pause(fresh_db_url, paused, companies.pause_company)
        waits = wait_for(lambda: pauser_waits_on(fresh_engine), 5, "the pause to wait")
        assert waits == ("advisory" if in_ring else "transactionid")
    pausing.finish()
    assert pausing.error is None

    taken_before = set(of(in_flight.batch, paused))
    assert len(taken_before) == 2
    with sessions() as claimer:
        later = claim(claimer)
        assert of(later, paused) == []
        assert {task.company_id for task in later} == {other}
        assert claimed_so_far(claimer, paused) == before | taken_before
        assert not queue_row(claimer, paused).ready


def test_without_the_claimers_lock_a_pause_would_let_the_claim_in_flight_take_tasks_after_it(
    fresh_engine: Engine, fresh_db_url: str
) -> None:
    """The control of the test above: the race is real, the claimers' lock is what wins it."""
    sessions = make_sessionmaker(fresh_engine)
    paused, _, stop = _two_companies_with_work(sessions, in_ring=True)
    with claim_stopped_at(fresh_db_url, fresh_engine, stop, 4) as in_flight:
        pausing = start_pause(fresh_db_url, paused, naked_pause)
        pausing.finish()  # committed, nothing to wait for
        assert pausing.error is None
        with sessions() as reader:
            before = claimed_so_far(reader, paused)
            assert queue_row(reader, paused).paused

    after_the_pause = set(of(in_flight.batch, paused))
    assert after_the_pause
    assert not after_the_pause & before


def _ready_and_short(sessions: sessionmaker[Session]) -> uuid.UUID:
    """A company in the ring whose only task was claimed: the next claim finds it short."""
    with sessions() as setup:
        company = insert_company(setup, "short").id
        insert_tasks(setup, company, 1)
        assert len(claim(setup, 1)) == 1  # exactly its share: not short, still ready
        assert queue_row(setup, company).ready
    return company


def _wake_up_bucket(sessions: sessionmaker[Session], company_id: uuid.UUID) -> int:
    with sessions() as session:
        bucket: int = session.execute(
            text("SELECT hashtext(CAST(:c AS text)) & (CAST(:buckets AS int) - 1)"),
            {"c": str(company_id), "buckets": claims.WAKE_LOCK_BUCKETS},
        ).scalar_one()
    return bucket


def test_a_claim_that_finds_the_pausing_company_short_leaves_it_to_the_pause(
    fresh_engine: Engine, fresh_db_url: str
) -> None:
    """The pause holds the company's row and waits for the claimers' lock; the claim holds
    that lock and would settle the company (write its row). The pause's wake-up lock (shared)
    makes the claim's try-lock fail, so it leaves the row alone: no deadlock, and the paused
    company is not settled back into the ring.

    The claim is stopped at the reservation, holding the claims' barrier: the pause comes,
    and the claim reads the ring as it was before it (the pause has not committed).
    """
    sessions = make_sessionmaker(fresh_engine)
    company = _ready_and_short(sessions)
    with claim_stopped_at(fresh_db_url, fresh_engine, AdvisoryLock.reservation(), 10) as claim_:
        pausing = start_pause(fresh_db_url, company, companies.pause_company)
        assert wait_for(lambda: pauser_waits_on(fresh_engine), 5, "the pause") == "advisory"
    pausing.finish()

    assert pausing.error is None
    assert claim_.batch == []  # short
    assert _wake_up_bucket(sessions, company) not in claim_.wake_locks
    with sessions() as claimer:
        row = queue_row(claimer, company)
        assert (row.paused, row.ready) == (True, False)
        insert_tasks(claimer, company, 1)
        assert claim(claimer) == []


def test_without_the_wake_up_lock_that_claim_passes_over_the_row_the_pause_holds(
    fresh_engine: Engine, fresh_db_url: str
) -> None:
    """The test above with a pause that takes only the claimers' lock after its UPDATE.

    Before migration 0011 the two deadlocked: the claim's settle waited for the row the
    pause had written, the pause for the claimers' lock the claim held (PostgreSQL aborted
    one after `deadlock_timeout`). The settle now locks its rows SKIP LOCKED: the claim gets
    the company's wake-up lock (nobody holds it), passes over the row, and commits; then the
    pause commits. Neither fails, and the paused company stays out of the ring.
    """

    def pause_without_wake_up_lock(conn: psycopg.Connection[Any], company_id: uuid.UUID) -> None:
        naked_pause(conn, company_id)
        conn.execute("SELECT pg_advisory_xact_lock(%(key)s)", {"key": claims.CLAIM_LOCK_KEY})

    sessions = make_sessionmaker(fresh_engine)
    company = _ready_and_short(sessions)
    with claim_stopped_at(fresh_db_url, fresh_engine, AdvisoryLock.reservation(), 10) as claim_:
        pausing = start_pause(fresh_db_url, company, pause_without_wake_up_lock)
        assert wait_for(lambda: pauser_waits_on(fresh_engine), 5, "the pause") == "advisory"
    pausing.finish()

    assert pausing.error is None
    assert claim_.batch == []  # short
    # The settle was on for the company: only the row lock kept it off the row.
    assert _wake_up_bucket(sessions, company) in claim_.wake_locks
    with sessions() as session:
        row = queue_row(session, company)
        assert (row.paused, row.ready) == (True, False)


def test_the_locks_that_stop_a_claim_are_the_ones_fairq_claim_takes(db_session: Session) -> None:
    """The numbers above, and db/claims.py's claimers' lock, as db/sql/claim.sql spells them."""
    source = db_session.execute(
        text("SELECT prosrc FROM pg_proc WHERE oid = 'fairq_claim'::regproc")
    ).scalar_one()
    assert f"pg_advisory_xact_lock_shared({claims.CLAIM_LOCK_KEY})" in source
    assert f"pg_advisory_xact_lock({RESERVATION_LOCK_KEY})" in source
    assert f"pg_advisory_xact_lock({LIMIT_LOCK_NAMESPACE}, b)" in source
    assert f"::text) & {LIMIT_LOCK_BUCKETS - 1}" in source


@dataclass
class Claimers:
    """Claimer threads, each on its own connection: claim, complete, again, until stopped."""

    url: str
    count: int
    batch_size: int
    stop: threading.Event = field(default_factory=threading.Event)
    batches: list[list[claims.ClaimedTask]] = field(default_factory=list)
    failures: list[BaseException] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, worker: int) -> None:
        engine = make_engine(self.url, application_name="pause-claimer", poolclass=pool.NullPool)
        try:
            with make_sessionmaker(engine)() as session:
                while not self.stop.is_set():
                    batch = claims.claim(
                        driver_connection(session, transaction=False),
                        worker_id=f"claimer:{worker}",
                        batch_size=self.batch_size,
                    )
                    session.commit()
                    if not batch:
                        time.sleep(0.002)
                        continue
                    with self.lock:
                        self.batches.append(batch)
                    claims.complete_tasks(
                        driver_connection(session, transaction=False),
                        list(batch),
                    )
                    session.commit()
        except BaseException as exc:  # reported by the test
            self.failures.append(exc)
        finally:
            engine.dispose()

    @contextmanager
    def running(self) -> Iterator[None]:
        threads = [
            threading.Thread(target=self.run, args=(i,), daemon=True) for i in range(self.count)
        ]
        for thread in threads:
            thread.start()
        try:
            yield
        finally:
            self.stop.set()
            for thread in threads:
                thread.join(10)
        assert not any(thread.is_alive() for thread in threads), "a claimer hung"

    def claimed(self) -> list[uuid.UUID]:
        return [task.id for batch in self.batches for task in batch]


@pytest.mark.slow
def test_pauses_racing_eight_concurrent_claimers_never_let_a_claim_take_a_paused_task(
    fresh_engine: Engine, fresh_db_url: str
) -> None:
    """20 pause/resume cycles while 8 claimers drain the company and four others.

    What any claim took of the company is read inside each pause's transaction, once the
    pause holds the claimers' lock: every claim before it has committed. Until the resume,
    not one more of its tasks may be claimed, although claims run all along (the others'
    work) and the company gets new tasks meanwhile. Its share kept growing between pauses:
    the claimers were taking its tasks right up to each pause.
    """
    sessions = make_sessionmaker(fresh_engine)
    with sessions() as setup:
        paused = insert_company(setup, "paused").id
        insert_tasks(setup, paused, 3000)
        for i in range(4):
            insert_tasks(setup, insert_company(setup, f"other{i}").id, 1500)
    rng = random.Random(13)
    taken_at_pauses: list[int] = []
    claimers = Claimers(fresh_db_url, count=8, batch_size=5)
    with claimers.running(), sessions() as session:
        for _ in range(20):
            time.sleep(rng.uniform(0.02, 0.06))
            companies.pause_company(driver_connection(session, transaction=False), paused)
            taken = claimed_so_far(session, paused)
            session.commit()
            queue.create_task(
                driver_connection(session, transaction=False),
                company_id=paused,
                type="noop",
                payload={},
            )
            session.commit()
            time.sleep(rng.uniform(0.03, 0.08))
            assert claimed_so_far(session, paused) == taken
            session.commit()
            taken_at_pauses.append(len(taken))
            resume(session, paused)
        assert not claimers.failures, claimers.failures

    claimed = claimers.claimed()
    assert len(claimed) == len(set(claimed))
    increments = [b - a for a, b in itertools.pairwise(taken_at_pauses)]
    assert sum(1 for step in increments if step > 0) >= 15, taken_at_pauses


# -- cost ------------------------------------------------------------------------------------

# What a transaction read so far, over every table and index of the schema, by PostgreSQL's
# own per-relation counters: buffers, and live rows fetched through an index. Not index
# entries: dead ones that a transaction open anywhere on the server keeps from being marked
# dead are read again by every claim, paused companies or not.
READ_SO_FAR = text(
    "SELECT sum(pg_stat_get_xact_blocks_fetched(c.oid)), "
    "sum(pg_stat_get_xact_tuples_fetched(c.oid)) FILTER (WHERE c.relkind = 'i') "
    "FROM pg_class c WHERE c.relnamespace = 'public'::regnamespace"
)


def _claim_reads(session: Session) -> tuple[int, int]:
    """`(buffers, rows)` a claim of 100 reads."""
    before = session.execute(READ_SO_FAR).one()
    batch = claims.claim(
        driver_connection(session, transaction=False), worker_id="cost:1", batch_size=100
    )
    after = session.execute(READ_SO_FAR).one()
    session.commit()
    assert len(batch) == 100
    buffers, rows = (int(a - b) for a, b in zip(after, before, strict=True))
    return buffers, rows


def _median_reads(session: Session) -> tuple[float, float]:
    claims = [_claim_reads(session) for _ in range(3)]
    return statistics.median(c[0] for c in claims), statistics.median(c[1] for c in claims)


def test_a_claim_reads_about_as_much_with_2000_paused_companies_with_due_work(
    fresh_engine: Engine,
) -> None:
    """Counts, not timings, as `tests/test_fair_claim.py` measures the claim.

    50 companies with work, then 2,000 more with due work, all paused: 1,000 while in the
    ring, 1,000 before they were ever promoted. A paused company is in neither the ring's
    index nor the promotion's (migration 0007), so no claim reads it. (Were it left in the
    promotion's index, every claim would fetch the 1,000 waiting ones' rows: 2,250 rows
    instead of 250.) On a database of its own, like the reference test.
    """
    with make_sessionmaker(fresh_engine)() as session:
        insert_companies_with_tasks(session, 50, 60, "few")
        claim(session, 100)
        few = _median_reads(session)

        in_ring = insert_companies_with_tasks(session, 1000, 5, "ring")
        claim(session, 100)  # promotes them all (PROMOTE_LIMIT)
        assert session.execute(
            text("SELECT count(*) FROM company_queues WHERE ready AND company_id = ANY(:ids)"),
            {"ids": in_ring},
        ).scalar_one() == len(in_ring)
        waiting = insert_companies_with_tasks(session, 1000, 5, "waiting")
        # pause_company's UPDATE for each, in one statement: no claim is in flight here.
        session.execute(
            text("UPDATE companies SET paused = true WHERE id = ANY(:ids)"),
            {"ids": in_ring + waiting},
        )
        session.commit()
        # The ring's index still holds entries of the 1,000 that were in it, which the next
        # claims step over (and mark dead, once no open transaction may still see them).
        for _ in range(2):
            claim(session, 100)
        many = _median_reads(session)

    for what, before, after in zip(("buffers", "rows"), few, many, strict=True):
        assert after <= 1.25 * before, (what, few, many)
