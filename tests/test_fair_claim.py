"""The weighted fair claim (migration 0003, `db.claims.claim`, `db.fair_share`).

What must hold: the claim is work-conserving (a lone company fills whole batches); companies
take turns, each up to its weight a turn, so shares across batches are proportional to the
weights; a company that was idle banks no credit; `max_in_flight` is never exceeded, also
under concurrent claimers; no task is claimed twice; a task that becomes pending while a
claimer decides its company is out of work is never forgotten (the wake-up lock); the cost
of a claim depends on the batch, not on how many companies exist nor on what the planner's
statistics say; and migration 0003 is safe on a live table.
"""

from __future__ import annotations

import collections
import json
import random
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
from alembic import command
from sqlalchemy import Engine, pool, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from db import claims, errors, queue
from db.engine import driver_connection, make_engine, make_sessionmaker
from tests import claim_plans, pg
from tests.factories import (
    MakeCompany,
    insert_company,
    insert_task,
    insert_tasks,
    insert_weighted_company,
    take_back,
)


def claim(session: Session, batch_size: int = 100, worker_id: str = "fair:1") -> list[uuid.UUID]:
    """Claim a batch and commit; return the ids of the claimed tasks in claim order."""
    batch = claims.claim(
        driver_connection(session, transaction=False), worker_id=worker_id, batch_size=batch_size
    )
    session.commit()
    return [task.id for task in batch]


def claim_tasks(session: Session, batch_size: int = 100) -> list[claims.ClaimedTask]:
    """Claim a batch and commit; return the claimed tasks."""
    batch = claims.claim(
        driver_connection(session, transaction=False), worker_id="fair:1", batch_size=batch_size
    )
    session.commit()
    return batch


def owners(session: Session, task_ids: Sequence[uuid.UUID]) -> list[uuid.UUID]:
    """The company of each task, in the order given."""
    rows: dict[uuid.UUID, uuid.UUID] = dict(
        session.execute(
            text("SELECT id, company_id FROM tasks WHERE id = ANY(:ids)"), {"ids": list(task_ids)}
        ).all()
    )
    return [rows[i] for i in task_ids]


@dataclass(frozen=True)
class QueueState:
    """A company's `company_queues` row."""

    due_at: Any
    ready: bool
    ring_position: int | None


def queue_state(session: Session, company_id: uuid.UUID) -> QueueState:
    """The claim's view of a company, read fresh."""
    row = session.execute(
        text("SELECT due_at, ready, ring_position FROM company_queues WHERE company_id = :c"),
        {"c": company_id},
    ).one()
    return QueueState(row.due_at, row.ready, row.ring_position)


def processing(session: Session, company_id: uuid.UUID) -> int:
    """How many of the company's tasks are `processing`."""
    count: int = session.execute(
        text("SELECT count(*) FROM tasks WHERE company_id = :c AND status = 'processing'"),
        {"c": company_id},
    ).scalar_one()
    return count


def add_companies(session: Session, count: int, tasks_each: int, prefix: str) -> list[uuid.UUID]:
    """`count` companies with `tasks_each` runnable tasks each, in two statements; commit."""
    ids: list[uuid.UUID] = list(
        session.execute(
            text(
                "INSERT INTO companies (name) SELECT :prefix || g "
                "FROM generate_series(1, :n) AS g RETURNING id"
            ),
            {"n": count, "prefix": prefix},
        ).scalars()
    )
    session.execute(
        text(
            "INSERT INTO tasks (company_id, type, payload) "
            "SELECT c, 'noop', '{}' FROM unnest(CAST(:ids AS uuid[])) AS c, "
            "generate_series(1, :per)"
        ),
        {"ids": ids, "per": tasks_each},
    )
    session.commit()
    return ids


# -- work-conserving, and turns ------------------------------------------------------------


def test_a_lone_company_with_500_runnable_tasks_gets_a_full_batch_of_100(
    db_session: Session, make_company: MakeCompany
) -> None:
    only = make_company()
    tasks = insert_tasks(db_session, only.id, 500)

    assert claim(db_session, 100) == tasks[:100]
    assert claim(db_session, 100) == tasks[100:200]


def test_with_equal_weights_a_short_batch_takes_every_companys_next_task_first(
    db_session: Session, make_company: MakeCompany
) -> None:
    """Four companies, 10 tasks each: a batch of 6 is each one's oldest, then two seconds.

    One task a turn, in ring order (companies join the ring in the order their work came
    due), however many tasks each has waiting.
    """
    companies = [make_company(f"c{i}").id for i in range(4)]
    tasks = [
        insert_tasks(db_session, company, 10, newest_age_seconds=100 * (4 - i))
        for i, company in enumerate(companies)
    ]

    batch = claim(db_session, 6)

    assert batch == [t[0] for t in tasks] + [t[1] for t in tasks[:2]]


def test_across_batches_companies_take_turns(
    db_session: Session, make_company: MakeCompany
) -> None:
    """A company served at the end of one batch is not served first in the next.

    Three companies with equal weights and batches of 2: the turns go round the ring across
    batch boundaries, A B | C A | B C | A B ..., so after every batch no company is more
    than one task ahead of another.
    """
    companies = [make_company(f"c{i}").id for i in range(3)]
    for i, company in enumerate(companies):
        insert_tasks(db_session, company, 20, newest_age_seconds=100 * (3 - i))

    served: list[uuid.UUID] = []
    for _ in range(12):
        batch = claim(db_session, 2)
        assert len(batch) == 2
        served.extend(owners(db_session, batch))
        counts = collections.Counter(served)
        assert max(counts.values()) - min(counts[c] for c in companies) <= 1, counts

    assert served == companies * 8


@pytest.mark.parametrize("batch_size", [5, 10, 100])
def test_weights_1_2_4_share_the_claimed_tasks_proportionally(
    db_session: Session, make_weighted_company: MakeCompany, batch_size: int
) -> None:
    """Backlogged companies of weights 1, 2 and 4 get 1/7, 2/7 and 4/7 of 2,800 tasks.

    The weight-1 company has the oldest tasks by far: age does not matter, weight does.
    Batch sizes that do not divide the weight sum (5, 10) end batches in the middle of a
    turn: the cursor carries the rest of it into the next batch. Within 15% of the ideal
    share, and in fact within one quantum (deficit round robin's bound).
    """
    weights = (1, 2, 4)
    companies = [make_weighted_company(f"w{w}", weight=w).id for w in weights]
    for company, age in zip(companies, (500_000, 100_000, 0), strict=True):
        insert_tasks(db_session, company, 2000, newest_age_seconds=age)

    total = 2800
    claimed: list[uuid.UUID] = []
    while len(claimed) < total:
        batch = claim(db_session, batch_size)
        assert len(batch) == batch_size  # everybody is backlogged: batches are full
        claimed.extend(batch)

    counts = collections.Counter(owners(db_session, claimed))
    for company, weight in zip(companies, weights, strict=True):
        ideal = total * weight / sum(weights)
        assert abs(counts[company] - ideal) <= 0.15 * ideal, (weights, counts)
        assert abs(counts[company] - ideal) <= weight, (weights, counts)


def test_an_idle_company_is_served_in_the_next_batch_and_banks_no_credit(
    db_session: Session, make_company: MakeCompany
) -> None:
    """C, idle while A and B were served for 30 batches, gets its turn at once, then its share.

    No starvation: C's first task is in the very next batch. No banked credit: C does not
    get a burst to catch up for the time it had no work; over the next batches its share is
    A's and B's (equal weights), to within a task.
    """
    a, b, c = (make_company(n).id for n in ("a", "b", "c"))
    insert_tasks(db_session, a, 500, newest_age_seconds=3600)
    insert_tasks(db_session, b, 500, newest_age_seconds=3600)
    for _ in range(30):
        assert len(claim(db_session, 10)) == 10

    c_tasks = insert_tasks(db_session, c, 100)
    first = claim(db_session, 10)

    assert c_tasks[0] in first
    first_counts = collections.Counter(owners(db_session, first))
    assert first_counts[c] <= 4, first_counts
    served = list(first)
    for _ in range(9):
        served.extend(claim(db_session, 10))
    counts = collections.Counter(owners(db_session, served))
    assert sum(counts.values()) == 100
    assert abs(counts[c] - counts[a]) <= 1, counts
    assert abs(counts[c] - counts[b]) <= 1, counts


def test_weights_above_the_batch_size_keep_their_proportion(
    db_session: Session, make_weighted_company: MakeCompany
) -> None:
    """Weights 400 and 100 with batches of 100: 80% and 20%, as with small weights.

    Deficit round robin serves the weight-400 company four whole batches, then the other
    one a whole batch; the cursor's credit carries the interrupted turn across batches.
    """
    heavy = make_weighted_company("heavy", weight=400).id
    light = make_weighted_company("light", weight=100).id
    insert_tasks(db_session, heavy, 3000, newest_age_seconds=60)
    insert_tasks(db_session, light, 3000)

    claimed: list[uuid.UUID] = []
    for _ in range(30):
        claimed.extend(claim(db_session, 100))

    counts = collections.Counter(owners(db_session, claimed))
    assert abs(counts[heavy] - 2400) <= 400, counts  # within one quantum of 80%
    assert abs(counts[light] - 600) <= 100, counts


def test_a_turn_continued_from_the_previous_batch_is_handed_out_in_serving_order(
    db_session: Session, make_weighted_company: MakeCompany
) -> None:
    """Weights 4 and 1, batches of 3 then 10: the second batch starts with A's last 2 tasks.

    Batch 1 (ring A, B... from where the cursor stands): served in turns; it ends in the
    middle of A's turn of 4. Batch 2 finishes that turn (2 tasks), then B's 1, A's 4, B's 1,
    and 2 of A's next turn: A A B A A A A B A A.
    """
    a = make_weighted_company("a", weight=4).id
    b = make_weighted_company("b", weight=1).id
    insert_tasks(db_session, b, 50, newest_age_seconds=3600)  # B's work came due first
    insert_tasks(db_session, a, 50)

    assert owners(db_session, claim(db_session, 3)) == [b, a, a]  # A has 2 of 4 left
    assert owners(db_session, claim(db_session, 10)) == [a, a, b, a, a, a, a, b, a, a]


# -- max_in_flight ---------------------------------------------------------------------------


def _complete(session: Session, tasks: Sequence[claims.ClaimedTask]) -> None:
    assert claims.complete_tasks(driver_connection(session, transaction=False), list(tasks)) == []
    session.commit()


def test_max_in_flight_limits_the_leases_a_company_holds(
    db_session: Session, make_weighted_company: MakeCompany
) -> None:
    limited = make_weighted_company("limited", max_in_flight=3).id
    insert_tasks(db_session, limited, 100)

    held = claim_tasks(db_session)
    assert len(held) == 3
    assert claim_tasks(db_session) == []  # at its limit: nothing more, however much work

    _complete(db_session, held[:1])
    [next_one] = claim_tasks(db_session)
    assert processing(db_session, limited) == 3
    _complete(db_session, [*held[1:], next_one])
    assert len(claim_tasks(db_session)) == 3


def test_other_companies_fill_the_batch_around_a_company_at_its_limit(
    db_session: Session, make_company: MakeCompany, make_weighted_company: MakeCompany
) -> None:
    limited = make_weighted_company("limited", max_in_flight=3).id
    others = [make_company(f"other{i}").id for i in range(2)]
    insert_tasks(db_session, limited, 100, newest_age_seconds=3600)
    for company in others:
        insert_tasks(db_session, company, 100)

    first = collections.Counter(t.company_id for t in claim_tasks(db_session, 20))
    second = collections.Counter(t.company_id for t in claim_tasks(db_session, 20))

    assert first[limited] == 3
    assert sum(first.values()) == 20  # work-conserving around the limit
    assert abs(first[others[0]] - first[others[1]]) <= 1
    assert second[limited] == 0
    assert sum(second.values()) == 20


def test_lowering_max_in_flight_below_the_leases_held_holds_back_until_below_it(
    db_session: Session, make_weighted_company: MakeCompany
) -> None:
    limited = make_weighted_company("limited", max_in_flight=5).id
    insert_tasks(db_session, limited, 100)
    held = claim_tasks(db_session)
    assert len(held) == 5

    db_session.execute(
        text("UPDATE companies SET max_in_flight = 2 WHERE id = :id"), {"id": limited}
    )
    db_session.commit()
    assert claim_tasks(db_session) == []
    _complete(db_session, held[:3])  # 2 left: at the new limit
    assert claim_tasks(db_session) == []
    _complete(db_session, held[3:4])
    assert len(claim_tasks(db_session)) == 1


# A test-only record of the in-flight count of the limited companies after every statement
# that changes `tasks`, as the writing transaction sees it (its own changes and everything
# committed). Claims are serialized, so the count a claim sees at its end is the count right
# after it commits (completions still open only make it larger).
_IN_FLIGHT_RECORDER = """
CREATE TABLE test_in_flight (company_id uuid NOT NULL, held int NOT NULL);
CREATE FUNCTION test_record_in_flight() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO test_in_flight
    SELECT t.company_id, count(*) FROM tasks t
    JOIN companies c ON c.id = t.company_id AND c.max_in_flight IS NOT NULL
    WHERE t.status = 'processing'
    GROUP BY t.company_id;
    RETURN NULL;
END $$;
CREATE TRIGGER test_record_in_flight AFTER UPDATE ON tasks
    FOR EACH STATEMENT EXECUTE FUNCTION test_record_in_flight();
"""


def _most_in_flight(engine: Engine) -> dict[uuid.UUID, int]:
    with engine.connect() as conn:
        return dict(
            conn.execute(
                text("SELECT company_id, max(held) FROM test_in_flight GROUP BY company_id")
            ).all()
        )


@dataclass
class _Claimers:
    """Claimer threads, each on its own engine, claiming until told to stop and drained."""

    url: str
    count: int
    batch_size: int
    done: threading.Event = field(default_factory=threading.Event)
    batches: list[list[claims.ClaimedTask]] = field(default_factory=list)
    failures: list[BaseException] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, worker: int, pause: Callable[[], float]) -> None:
        engine = make_engine(self.url, application_name="fair-claimer", poolclass=pool.NullPool)
        try:
            with make_sessionmaker(engine)() as session:
                while True:
                    batch = claims.claim(
                        driver_connection(session, transaction=False),
                        worker_id=f"claimer:{worker}",
                        batch_size=self.batch_size,
                    )
                    session.commit()
                    if batch:
                        with self.lock:
                            self.batches.append(batch)
                        time.sleep(pause())
                        claims.complete_tasks(
                            driver_connection(session, transaction=False), list(batch)
                        )
                        session.commit()
                        continue
                    if self.done.is_set() and not _pending(session):
                        return
                    time.sleep(0.002)
        except BaseException as exc:  # reported by the test
            self.failures.append(exc)
        finally:
            engine.dispose()

    def start(self, pause: Callable[[], float] = lambda: 0.0) -> list[threading.Thread]:
        threads = [
            threading.Thread(target=self.run, args=(i, pause), daemon=True)
            for i in range(self.count)
        ]
        for thread in threads:
            thread.start()
        return threads

    def claimed(self) -> list[uuid.UUID]:
        return [t.id for batch in self.batches for t in batch]


def _pending(session: Session) -> int:
    count: int = session.execute(
        text("SELECT count(*) FROM tasks WHERE status = 'pending'")
    ).scalar_one()
    session.commit()
    return count


def _join(threads: Sequence[threading.Thread], timeout: float, diagnose: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    if any(thread.is_alive() for thread in threads):
        pytest.fail(f"claimers did not drain the queue within {timeout}s: {diagnose()}")


def _diagnose(engine: Engine) -> Callable[[], str]:
    def diagnose() -> str:
        with engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT q.company_id, q.ready, q.due_at, count(t.id) AS pending, "
                    "min(t.run_after) AS earliest FROM company_queues q "
                    "JOIN tasks t ON t.company_id = q.company_id AND t.status = 'pending' "
                    "GROUP BY q.company_id, q.ready, q.due_at"
                )
            ).all()
        return "companies with pending tasks: " + repr([tuple(r) for r in rows])

    return diagnose


@pytest.mark.slow
def test_max_in_flight_is_never_exceeded_under_eight_concurrent_claimers(
    fresh_engine: Engine, fresh_db_url: str
) -> None:
    """8 claimer threads drain 480 tasks; limited companies never hold more than their limit.

    Checked three ways: a sampler reading the processing count while they run; a test-only
    trigger recording the count after every claim and completion; and, at the end, every
    batch's share of each limited company.
    """
    sessions = make_sessionmaker(fresh_engine)
    limits = {"limit3": 3, "limit5": 5, "free1": None, "free2": None}
    with sessions() as setup:
        setup.execute(text(_IN_FLIGHT_RECORDER))
        setup.commit()
        companies = {
            name: insert_weighted_company(setup, name, max_in_flight=limit).id
            for name, limit in limits.items()
        }
        for company in companies.values():
            insert_tasks(setup, company, 120)
    limit_of = {companies[n]: limit for n, limit in limits.items() if limit is not None}

    sampled: collections.Counter[uuid.UUID] = collections.Counter()
    stop_sampling = threading.Event()

    def sample() -> None:
        with sessions() as session:
            while not stop_sampling.is_set():
                for company, held in session.execute(
                    text(
                        "SELECT company_id, count(*) FROM tasks WHERE status = 'processing' "
                        "AND company_id = ANY(:ids) GROUP BY company_id"
                    ),
                    {"ids": list(limit_of)},
                ):
                    sampled[company] = max(sampled[company], held)
                session.commit()
                time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    claimers = _Claimers(fresh_db_url, count=8, batch_size=10)
    claimers.done.set()
    rng = random.Random(9)
    _join(claimers.start(lambda: rng.uniform(0, 0.004)), 60, _diagnose(fresh_engine))
    stop_sampling.set()
    sampler.join(5)

    assert not claimers.failures, claimers.failures
    claimed = claimers.claimed()
    assert len(claimed) == len(set(claimed)) == 480
    for company, limit in limit_of.items():
        assert sampled[company] <= limit, (sampled, limit_of)
        for batch in claimers.batches:
            assert sum(t.company_id == company for t in batch) <= limit
    recorded = _most_in_flight(fresh_engine)
    for company, limit in limit_of.items():
        # Reached (the limit was exercised) and never exceeded.
        assert recorded[company] == limit, (recorded, limit_of)


@pytest.mark.slow
def test_eight_claimers_with_weights_and_limits_claim_every_task_once_while_work_arrives(
    fresh_engine: Engine, fresh_db_url: str
) -> None:
    """8 claimers drain ~2,000 tasks while another thread inserts more and cancels some.

    Companies have mixed weights and limits; inserts come as multi-company statements, some
    scheduled a fraction of a second ahead (they must be promoted when due); the API cancels
    random pending tasks meanwhile. No task is claimed twice, no cancelled task is claimed,
    every other task is claimed exactly once, and no limit is exceeded.
    """
    sessions = make_sessionmaker(fresh_engine)
    spec = [(1, None), (2, 6), (4, None), (1, 3), (3, None), (1, 10)]
    with sessions() as setup:
        setup.execute(text(_IN_FLIGHT_RECORDER))
        setup.commit()
        companies = [
            insert_weighted_company(setup, f"c{i}", weight=w, max_in_flight=m).id
            for i, (w, m) in enumerate(spec)
        ]
        inserted: list[uuid.UUID] = []
        for company in companies:
            inserted.extend(insert_tasks(setup, company, 170))
    limit_of = {c: m for c, (_, m) in zip(companies, spec, strict=True) if m is not None}

    cancelled: list[uuid.UUID] = []
    feeder_failures: list[BaseException] = []

    def feed(claimers: _Claimers) -> None:
        rng = random.Random(5)
        try:
            with sessions() as session:
                for _ in range(20):
                    # One statement, tasks for every company; a fifth of them 0.3 s ahead.
                    ids = (
                        session.execute(
                            text(
                                "INSERT INTO tasks (company_id, type, payload, run_after) "
                                "SELECT (CAST(:companies AS uuid[]))[1 + g % 6], 'noop', '{}', "
                                "now() + CASE WHEN g % 5 = 0 THEN interval '300 ms' "
                                "ELSE interval '0' END "
                                "FROM generate_series(1, 50) AS g RETURNING id"
                            ),
                            {"companies": companies},
                        )
                        .scalars()
                        .all()
                    )
                    session.commit()
                    inserted.extend(ids)
                    for task_id in rng.sample(inserted, 8):
                        owner = session.execute(
                            text("SELECT company_id FROM tasks WHERE id = :id"), {"id": task_id}
                        ).scalar_one()
                        try:
                            queue.cancel_task(
                                driver_connection(session, transaction=False), owner, task_id
                            )
                        except errors.Conflict:
                            session.rollback()  # already claimed (or cancelled): fine
                            continue
                        session.commit()
                        cancelled.append(task_id)
                    time.sleep(0.02)
        except BaseException as exc:  # reported by the test
            feeder_failures.append(exc)
        finally:
            claimers.done.set()

    claimers = _Claimers(fresh_db_url, count=8, batch_size=20)
    threads = claimers.start()
    feeder = threading.Thread(target=feed, args=(claimers,), daemon=True)
    feeder.start()
    feeder.join(60)
    _join(threads, 60, _diagnose(fresh_engine))

    assert not feeder_failures, feeder_failures
    assert not claimers.failures, claimers.failures
    claimed = claimers.claimed()
    assert len(claimed) == len(set(claimed)), "a task was claimed twice"
    assert not set(claimed) & set(cancelled), "a cancelled task was claimed"
    assert set(claimed) | set(cancelled) == set(inserted), "a task was never claimed"
    assert len(inserted) == 6 * 170 + 20 * 50
    assert cancelled  # the race with the claimers was exercised
    with sessions() as check:
        statuses: dict[str, int] = dict(
            check.execute(
                text("SELECT status, count(*) FROM tasks WHERE attempts <= 1 GROUP BY status")
            ).all()
        )
    assert statuses == {"completed": len(claimed), "cancelled": len(cancelled)}
    recorded = _most_in_flight(fresh_engine)
    for company, limit in limit_of.items():
        assert recorded.get(company, 0) <= limit, (recorded, limit_of)


# -- the wake-up lock: no task is forgotten --------------------------------------------------


def _ready_with_nothing_pending(
    sessions: sessionmaker[Session],
) -> tuple[uuid.UUID, claims.ClaimedTask]:
    """A company whose only task was just claimed, still marked ready (it was not short)."""
    with sessions() as setup:
        company = insert_company(setup, "k").id
        insert_task(setup, company)
        [task] = claims.claim(
            driver_connection(setup, transaction=False), worker_id="first:1", batch_size=1
        )
        setup.commit()
        assert queue_state(setup, company).ready
    return company, task


def test_a_task_inserted_while_a_claim_finds_its_company_out_of_work_is_claimed_later(
    fresh_engine: Engine,
) -> None:
    """The claim comes up short for K while K's new task is uncommitted: K stays ready.

    The writer's trigger holds K's wake-up lock (shared) until it commits; the claimer's
    try-lock fails, so it leaves K as it is instead of marking it out of work. Without that,
    K would be settled as idle, and the writer's trigger (which saw K ready with an early
    due_at, so did not lower it) would not wake it: the task would wait forever.
    """
    sessions = make_sessionmaker(fresh_engine)
    company, _ = _ready_with_nothing_pending(sessions)
    with sessions() as claimer, sessions() as writer:
        task, _ = queue.create_task(
            driver_connection(writer, transaction=False),
            company_id=company,
            type="noop",
            payload={},
        )

        assert claim(claimer) == []  # short for K: nothing K has is visible yet
        assert queue_state(claimer, company).ready  # not settled: its writer is still open

        writer.commit()
        assert claim(claimer) == [task.id]
        # Short again, and nobody writing: now K is settled, out of work.
        assert claim(claimer) == []
        state = queue_state(claimer, company)
        assert (state.due_at, state.ready) == (None, False)


def test_settling_a_company_without_its_wake_up_lock_would_lose_a_task_being_inserted(
    fresh_engine: Engine,
) -> None:
    """The control of the test above: the race is real, the lock is what wins it.

    The same interleaving, but the company is settled by the claim's settle statement alone
    (read from `fairq_claim`, without the try-lock before it) while the writer is open: it is
    marked out of work, the writer commits, and no claim ever takes the task.
    """
    sessions = make_sessionmaker(fresh_engine)
    company, _ = _ready_with_nothing_pending(sessions)
    with sessions() as claimer, sessions() as writer:
        task, _ = queue.create_task(
            driver_connection(writer, transaction=False),
            company_id=company,
            type="noop",
            payload={},
        )
        settle = claim_plans.settle_statement(claimer)
        driver_connection(claimer).execute(settle, {"company_ids": [company]})
        claimer.commit()
        writer.commit()

        assert claim(claimer) == []
        assert queue_state(claimer, company).due_at is None  # forgotten
        pending = claimer.execute(
            text("SELECT status FROM tasks WHERE id = :id"), {"id": task.id}
        ).scalar_one()
        assert pending == "pending"


def _release(session: Session, lease: claims.ClaimedTask, company: uuid.UUID) -> None:
    assert claims.release_tasks(driver_connection(session, transaction=False), [lease]) == []


def _retry(session: Session, lease: claims.ClaimedTask, company: uuid.UUID) -> None:
    assert claims.schedule_retry(
        driver_connection(session, transaction=False),
        lease.id,
        lease.lease_token,
        delay_seconds=0,
        error="HTTP 503",
    )


def _api_retry(session: Session, lease: claims.ClaimedTask, company: uuid.UUID) -> None:
    queue.retry_task(driver_connection(session, transaction=False), company, lease.id)


def _expire(session: Session, lease: claims.ClaimedTask, company: uuid.UUID) -> None:
    assert [e.id for e in take_back(session, stale_after=60)] == [lease.id]


@pytest.mark.parametrize(
    "make_pending",
    [_release, _retry, _api_retry, _expire],
    ids=["release", "retry", "api-retry", "expired-lease"],
)
def test_a_task_made_pending_in_an_open_transaction_is_claimed_after_it_commits(
    fresh_engine: Engine, make_pending: Callable[[Session, claims.ClaimedTask, uuid.UUID], None]
) -> None:
    """As above for a task made pending by an UPDATE: the row trigger holds the lock too."""
    sessions = make_sessionmaker(fresh_engine)
    company, lease = _ready_with_nothing_pending(sessions)
    with sessions() as setup:
        if make_pending is _api_retry:
            assert claims.fail_task(
                driver_connection(setup, transaction=False),
                lease.id,
                lease.lease_token,
                error="boom",
            )
        if make_pending is _expire:
            setup.execute(
                text("UPDATE tasks SET locked_at = now() - interval '1 hour' WHERE id = :id"),
                {"id": lease.id},
            )
        setup.commit()
    with sessions() as claimer, sessions() as writer:
        make_pending(writer, lease, company)

        assert claim(claimer) == []
        assert queue_state(claimer, company).ready

        writer.commit()
        assert claim(claimer) == [lease.id]


def test_a_repeatable_read_writer_whose_snapshot_predates_a_settle_fails_and_retries(
    fresh_engine: Engine,
) -> None:
    """An operator's script in REPEATABLE READ inserts a task for a company just settled.

    The script's snapshot is taken before the claimer settles K (out of work); its insert
    comes after the claimer committed, so its trigger would read K's row as of that old
    snapshot. The trigger locks the row first, so the insert fails with a serialization
    failure (nothing stored, the writer retries) instead of storing a task nobody claims.
    """
    sessions = make_sessionmaker(fresh_engine)
    company, _ = _ready_with_nothing_pending(sessions)
    with sessions() as claimer, sessions() as writer:
        writer.connection(execution_options={"isolation_level": "REPEATABLE READ"})
        writer.execute(text("SELECT count(*) FROM company_queues")).one()  # the snapshot

        assert claim(claimer) == []
        assert not queue_state(claimer, company).ready  # settled: out of work

        with pytest.raises(OperationalError) as failed:
            queue.create_task(
                driver_connection(writer, transaction=False),
                company_id=company,
                type="noop",
                payload={},
            )
        assert isinstance(failed.value.orig, psycopg.errors.SerializationFailure)
        writer.rollback()

        # The retry, in a new transaction (and snapshot), is stored and claimed.
        writer.connection(execution_options={"isolation_level": "REPEATABLE READ"})
        task, _ = queue.create_task(
            driver_connection(writer, transaction=False),
            company_id=company,
            type="noop",
            payload={},
        )
        writer.commit()

        assert claim(claimer) == [task.id]


def test_a_settled_company_is_woken_by_its_next_task(db_session: Session) -> None:
    company = insert_company(db_session, "k").id
    insert_task(db_session, company)
    assert len(claim(db_session)) == 1
    assert claim(db_session) == []
    assert not queue_state(db_session, company).ready

    task = insert_task(db_session, company)

    assert queue_state(db_session, company).due_at == task.run_after
    assert claim(db_session) == [task.id]


def test_a_company_whose_pending_tasks_are_all_delayed_is_claimed_once_they_are_due(
    fresh_engine: Engine,
) -> None:
    sessions = make_sessionmaker(fresh_engine)
    with sessions() as session:
        company = insert_company(session, "k").id
        delayed = insert_task(session, company, run_after=text("now() + interval '1 second'"))

        assert claim(session) == []
        state = queue_state(session, company)
        assert (state.ready, state.due_at) == (False, delayed.run_after)

        deadline = time.monotonic() + 5
        while not (batch := claim(session)):
            assert time.monotonic() < deadline, "the delayed task was never claimed"
            time.sleep(0.05)
        assert batch == [delayed.id]
        due = session.execute(text("SELECT now() >= :at"), {"at": delayed.run_after})
        assert due.scalar_one()


def test_moving_a_delayed_task_earlier_lowers_due_at_so_the_next_claim_takes_it(
    db_session: Session,
) -> None:
    company = insert_company(db_session, "k").id
    # Created a while ago: a company whose last task is a second old is settled when short.
    created = text("now() - interval '2 seconds'")
    later = insert_task(
        db_session, company, run_after=text("now() + interval '1 day'"), created_at=created
    )
    moved = insert_task(
        db_session, company, run_after=text("now() + interval '2 days'"), created_at=created
    )
    assert claim(db_session) == []
    assert queue_state(db_session, company).due_at == later.run_after

    db_session.execute(
        text("UPDATE tasks SET run_after = now() - interval '1 minute' WHERE id = :id"),
        {"id": moved.id},
    )
    db_session.commit()

    earlier = db_session.execute(
        text("SELECT run_after FROM tasks WHERE id = :id"), {"id": moved.id}
    ).scalar_one()
    assert queue_state(db_session, company).due_at == earlier
    assert claim(db_session) == [moved.id]
    assert claim(db_session) == []
    state = queue_state(db_session, company)
    assert (state.due_at, state.ready) == (later.run_after, False)


def test_a_busy_company_that_ran_short_stays_in_the_ring_unwritten_until_idle_a_second(
    db_session: Session,
) -> None:
    """A steady trickle: each task claimed as it comes, the company short after each claim.

    While one of its tasks was created within the last second, the claim leaves its row as it
    is (ready, in the ring, no new version); once it has been idle for a second, the next
    claim that finds it short settles it.
    """
    company = insert_company(db_session, "k").id
    first = insert_task(db_session, company)
    assert claim(db_session) == [first.id]  # short, and settled: its only task is leased
    assert queue_state(db_session, company).ready is False
    second = insert_task(db_session, company)
    third = insert_task(db_session, company, run_after=text("now() + interval '1 hour'"))
    assert claim(db_session) == [second.id]
    version = db_session.execute(
        text("SELECT xmin::text FROM company_queues WHERE company_id = :c"), {"c": company}
    ).scalar_one()

    # Short again (the third is not due), its newest task a moment old: left as it is.
    assert claim(db_session) == []
    assert queue_state(db_session, company).ready is True
    assert (
        db_session.execute(
            text("SELECT xmin::text FROM company_queues WHERE company_id = :c"), {"c": company}
        ).scalar_one()
        == version
    )

    db_session.execute(
        text("UPDATE tasks SET created_at = created_at - interval '2 seconds' WHERE id = :id"),
        {"id": third.id},
    )
    db_session.commit()
    assert claim(db_session) == []
    state = queue_state(db_session, company)
    assert (state.due_at, state.ready) == (third.run_after, False)


# -- many companies: locks, cost and plans that do not depend on them ------------------------

WAKE_LOCKS = text(
    "SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'advisory' "
    "AND classid = CAST(:namespace AS oid) AND objsubid = 2"
)


@pytest.mark.slow
def test_one_statement_inserting_tasks_for_5000_companies_takes_at_most_64_wake_up_locks(
    db_session: Session,
) -> None:
    companies = add_companies(db_session, 5000, 0, "bulk")
    db_session.execute(
        text(
            "INSERT INTO tasks (company_id, type, payload) "
            "SELECT c, 'noop', '{}' FROM unnest(CAST(:ids AS uuid[])) AS c"
        ),
        {"ids": companies},
    )

    held = db_session.execute(WAKE_LOCKS, {"namespace": claims.WAKE_LOCK_NAMESPACE}).scalar_one()
    assert held == claims.WAKE_LOCK_BUCKETS  # every bucket once, not one lock per company
    db_session.commit()

    claimed: list[uuid.UUID] = []
    for _ in range(12):  # at most PROMOTE_LIMIT companies join the ring per claim
        claimed.extend(claim(db_session, 500))
    assert len(claimed) == len(set(claimed)) == 5000
    assert set(owners(db_session, claimed)) == set(companies)


def test_the_claim_reads_about_a_batch_of_the_ring_with_2000_companies_ready(
    fresh_engine: Engine,
) -> None:
    """The ring's index yields at most batch-size rows of 2,000 companies.

    The contenders' statement inside `fairq_claim`, as auto_explain logs it with ANALYZE and
    BUFFERS.

    On a database of its own: ring positions come from a sequence, so the shared database's
    ring index holds the dead entries of every rolled-back test ahead of this one's.
    """
    with make_sessionmaker(fresh_engine)() as db_session:
        add_companies(db_session, 2000, 3, "ring")
        for _ in range(3):  # promote everyone into the ring
            assert len(claim(db_session, 100)) == 100
        ready = db_session.execute(text("SELECT count(*) FROM company_queues WHERE ready"))
        assert ready.scalar_one() == 2000

        batch, statements = claim_plans.claim_statements(db_session, 100, analyze=True)

        assert len({task.company_id for task in batch}) == 100  # a turn each: 100 companies
        [contenders] = claim_plans.pick(statements, claim_plans.CONTENDERS)
        plan = contenders.plan
        ring = [
            node
            for node, _ in claim_plans.plan_nodes(plan)
            if node.get("Index Name") == "ix_company_queues_ring_position"
        ]
        assert ring, json.dumps(plan, indent=1)
        assert sum(node["Actual Rows"] * node["Actual Loops"] for node in ring) <= 100
        assert all(node.get("Rows Removed by Filter", 0) == 0 for node in ring)
        touched = sum(node["Shared Hit Blocks"] + node["Shared Read Blocks"] for node in ring)
        assert touched <= 10
        # The contenders the statement lists: the LIMIT under its aggregate.
        [listed] = [node for node in plan["Plans"] if node["Node Type"] == "Limit"]
        assert listed["Actual Rows"] == 100
        # What reading the whole ring would touch: its index and the rows of 2,000 companies.
        whole = db_session.execute(
            text(
                "SELECT (pg_relation_size('ix_company_queues_ring_position') "
                "+ pg_relation_size('company_queues')) / current_setting('block_size')::int"
            )
        ).scalar_one()
        assert whole >= 2 * touched, (whole, touched)


BLOCKS_TOUCHED = text(
    "SELECT sum(pg_stat_get_xact_blocks_fetched(c.oid)) FROM pg_class c "
    "WHERE c.relnamespace = 'public'::regnamespace"
)


def _claim_buffers(session: Session) -> int:
    """Buffers a claim of 100 touches (hits and reads over every table and index)."""
    before = session.execute(BLOCKS_TOUCHED).scalar_one()
    batch = claims.claim(
        driver_connection(session, transaction=False), worker_id="cost:1", batch_size=100
    )
    after = session.execute(BLOCKS_TOUCHED).scalar_one()
    session.commit()
    assert len(batch) == 100
    return int(after - before)


def test_a_claim_touches_about_as_many_buffers_with_2000_companies_as_with_50(
    fresh_engine: Engine,
) -> None:
    """Buffer counts, not timings: the claim's cost follows the batch, not the companies.

    Measured in each claim's transaction by PostgreSQL's own per-relation block counters, over
    every table and index of the schema, for whole claims (promotion, contenders, claim,
    settle). On a database of its own: the shared one carries the dead index entries of every
    rolled-back test, which a scan over more companies' ranges meets more of.
    """
    with make_sessionmaker(fresh_engine)() as session:
        add_companies(session, 50, 40, "few")
        claim(session, 100)
        few = statistics.median(_claim_buffers(session) for _ in range(3))

        add_companies(session, 1950, 5, "many")
        for _ in range(3):  # promote the newcomers (PROMOTE_LIMIT a claim): a one-off cost
            claim(session, 100)
        many = statistics.median(_claim_buffers(session) for _ in range(3))

    assert many <= 2 * few, (few, many)


TASK_INDEXES = {
    "ix_tasks_company_listing_unleased",
    "ix_tasks_pending_company_run_after",
    "ix_tasks_processing_company_locked_at",
    "pk_tasks",
}


@pytest.mark.slow
def test_claim_plans_stay_index_scans_when_200000_rows_arrive_after_analyze(
    db_session: Session,
) -> None:
    """Statistics say `tasks` is tiny; 200,000 rows arrived since. The plans do not care.

    Every statement of the claim is pinned to nested loops over index scans (the SET clauses
    of `fairq_claim`): no sequential scan, hash or merge join over tasks, and each scan of
    tasks is a per-company range (or a primary-key probe). The plans are those auto_explain
    logs for every statement the claim runs, its two rounds and its settle (a company with
    less work than its share) among them.
    """
    companies = add_companies(db_session, 20, 5, "stats")
    [short] = add_companies(db_session, 1, 1, "short")
    db_session.execute(
        text("UPDATE companies SET max_in_flight = 1000 WHERE id = ANY(:ids)"),
        {"ids": companies[::2]},
    )
    db_session.execute(text("ANALYZE tasks, companies, company_queues"))
    db_session.execute(
        text(
            "INSERT INTO tasks (company_id, type, payload, status, attempts, locked_at) "
            "SELECT (CAST(:ids AS uuid[]))[1 + g % 20], 'noop', '{}', "
            "CASE WHEN g % 4 = 0 THEN 'processing' ELSE 'pending' END, g % 4 / 3, "
            "CASE WHEN g % 4 = 0 THEN now() END "
            "FROM generate_series(1, 200000) AS g"
        ),
        {"ids": companies},
    )
    db_session.commit()

    batch, statements = claim_plans.claim_statements(db_session, 100)

    assert len(batch) == 100
    assert short in {task.company_id for task in batch}
    assert len(claim_plans.pick(statements, claim_plans.CONTENDERS)) == 2
    assert len(claim_plans.pick(statements, claim_plans.CLAIM)) == 2
    assert len(claim_plans.pick(statements, claim_plans.SETTLE)) == 1
    for statement in statements:
        name = statement.text[:60]
        nodes = list(claim_plans.plan_nodes(statement.plan))
        kinds = {node["Node Type"] for node, _ in nodes}
        assert not kinds & {"Hash Join", "Merge Join", "Bitmap Heap Scan"}, (name, kinds)
        for node, parents in nodes:
            if node.get("Relation Name") != "tasks" or "Scan" not in node["Node Type"]:
                continue  # not a read of tasks (the UPDATE of the claimed rows, say)
            assert node["Node Type"] in ("Index Scan", "Index Only Scan"), (name, node)
            assert node["Index Name"] in TASK_INDEXES, (name, node)
            if node["Index Name"] != "pk_tasks":
                assert node["Index Cond"].startswith("((company_id = ") or node[
                    "Index Cond"
                ].startswith("(company_id = "), (name, node)
            assert parents[-1] != "Sort", (name, parents)


def test_a_claim_finds_runnable_work_behind_a_thousand_companies_that_ran_dry(
    db_session: Session,
) -> None:
    """Work-conserving: an empty batch only when nothing is runnable.

    1,000 companies had one task each; ten batches of 100 took them all, each company
    getting exactly its share, so none came up short and all stay in the ring. Then the
    company last in the ring gets a task: the next claim must take it.
    """
    add_companies(db_session, 1000, 1, "dry")
    for _ in range(10):
        assert len(claim(db_session, 100)) == 100
    last = (
        db_session.execute(
            text("SELECT company_id FROM company_queues WHERE ready ORDER BY ring_position DESC")
        )
        .scalars()
        .first()
    )
    assert last is not None
    task = insert_task(db_session, last)

    assert claim(db_session, 100) == [task.id]


# -- migration 0003 on a live table ------------------------------------------------------------


def test_the_wake_up_lock_of_the_triggers_is_the_one_the_claimer_tries(db_session: Session) -> None:
    """`WAKE_LOCK_NAMESPACE` and `WAKE_LOCK_BUCKETS` of db/claims.py match migration 0003.

    By the triggers' source, and by behaviour: inserting a task holds exactly the lock
    `(namespace, hashtext(company_id) & (buckets - 1))` that `fairq_claim` tries.
    """
    sources: dict[str, str] = dict(
        db_session.execute(
            text(
                "SELECT proname, prosrc FROM pg_proc WHERE proname IN "
                "('fairq_note_pending_inserted', 'fairq_note_pending_updated')"
            )
        ).all()
    )
    assert len(sources) == 2
    for source in sources.values():
        assert f"pg_advisory_xact_lock_shared({claims.WAKE_LOCK_NAMESPACE}," in source
        assert f"::text) & {claims.WAKE_LOCK_BUCKETS - 1}" in source
        assert source.count("pg_advisory_xact_lock_shared(") == 1
    claim_source = db_session.execute(
        text("SELECT prosrc FROM pg_proc WHERE oid = 'fairq_claim'::regproc")
    ).scalar_one()
    assert f"pg_try_advisory_xact_lock({claims.WAKE_LOCK_NAMESPACE}, b.bucket)" in claim_source
    assert f"hashtext(x::text) & {claims.WAKE_LOCK_BUCKETS - 1} AS bucket" in claim_source

    company = insert_company(db_session, "k").id
    before = db_session.execute(WAKE_LOCKS, {"namespace": claims.WAKE_LOCK_NAMESPACE})
    assert before.scalar_one() == 0
    insert_task(db_session, company)
    [(bucket,)] = db_session.execute(
        text(
            "SELECT objid FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'advisory' "
            "AND classid = CAST(:namespace AS oid) AND objsubid = 2 AND mode = 'ShareLock'"
        ),
        {"namespace": claims.WAKE_LOCK_NAMESPACE},
    ).all()
    expected = db_session.execute(
        text("SELECT hashtext(CAST(:c AS text)) & (CAST(:buckets AS int) - 1)"),
        {"c": str(company), "buckets": claims.WAKE_LOCK_BUCKETS},
    ).scalar_one()
    assert bucket == expected


@pytest.fixture
def db_at_0002(server: pg.TestServer) -> Iterator[str]:
    """URL of a new database migrated to revision 0002 only, dropped after the test."""
    name = server.create_empty("fairq_test_0002")
    url = server.url(name)
    command.upgrade(pg.alembic_config(url), "0002")
    yield url
    server.drop(name)


def _seed_at_0002(url: str) -> dict[str, uuid.UUID]:
    """Companies as a 0002 database has them, with every kind of task; return their ids."""
    engine = make_engine(url, application_name="fairq-tests", poolclass=pool.NullPool)
    try:
        with engine.begin() as conn:

            def company(name: str) -> uuid.UUID:
                company_id: uuid.UUID = conn.execute(
                    text("INSERT INTO companies (name, api_key_hash) VALUES (:n, :n) RETURNING id"),
                    {"n": name},
                ).scalar_one()
                return company_id

            ids = {n: company(n) for n in ("runnable", "delayed", "mixed", "idle", "busy")}

            def task(owner: str, status: str, run_after: str) -> None:
                conn.execute(
                    text(
                        "INSERT INTO tasks (company_id, type, payload, status, run_after, "
                        "locked_at, lease_token, attempts) VALUES (:c, 'noop', '{}', :s, "
                        f"{run_after}, CASE WHEN :s = 'processing' THEN now() END, "
                        "CASE WHEN :s = 'processing' THEN gen_random_uuid() END, "
                        "CASE WHEN :s = 'processing' THEN 1 ELSE 0 END)"
                    ),
                    {"c": ids[owner], "s": status},
                )

            task("runnable", "pending", "now() - interval '10 minutes'")
            task("runnable", "pending", "now() - interval '5 minutes'")
            task("delayed", "pending", "now() + interval '1 day'")
            task("delayed", "pending", "now() + interval '2 days'")
            task("mixed", "pending", "now() + interval '1 hour'")
            task("mixed", "pending", "now() - interval '1 hour'")
            task("mixed", "completed", "now() - interval '3 hours'")
            task("idle", "completed", "now() - interval '1 hour'")
            task("idle", "cancelled", "now() - interval '1 hour'")
            task("busy", "processing", "now() - interval '1 hour'")
    finally:
        engine.dispose()
    return ids


def _check_backfill(url: str, ids: dict[str, uuid.UUID]) -> None:
    """company_queues as migration 0003 must leave it, and a claim taking the runnable work."""
    engine = make_engine(url, application_name="fairq-tests", poolclass=pool.NullPool)
    try:
        with make_sessionmaker(engine)() as session:
            expected: dict[uuid.UUID, Any] = dict(
                session.execute(
                    text(
                        "SELECT c.id, (SELECT min(t.run_after) FROM tasks t "
                        "WHERE t.company_id = c.id AND t.status = 'pending') FROM companies c"
                    )
                ).all()
            )
            assert expected[ids["idle"]] is None
            assert expected[ids["busy"]] is None
            assert expected[ids["delayed"]] is not None
            for name, company in ids.items():
                state = queue_state(session, company)
                assert (state.due_at, state.ready) == (expected[company], False), name
            cursor = session.execute(
                text(
                    "SELECT p.last_value, k.last_value "
                    "FROM fairq_claim_cursor_position p, fairq_claim_cursor_credit k"
                )
            )
            assert tuple(cursor.one()) == (0, 0)

            batch = claim_tasks(session)
            assert collections.Counter(t.company_id for t in batch) == {
                ids["runnable"]: 2,
                ids["mixed"]: 1,
            }
            assert queue_state(session, ids["delayed"]).ready is False
    finally:
        engine.dispose()


def test_upgrading_a_live_0002_database_backfills_company_queues_and_the_claim_works(
    db_at_0002: str,
) -> None:
    """Existing companies get their row: due_at the earliest pending run_after, or NULL.

    Delayed-only companies wait (due tomorrow), companies without pending tasks have no
    due_at; nobody is in the ring yet, and the first claim promotes whoever is due.
    Downgrading to 0002 and upgrading again on the same data does it all again.
    """
    ids = _seed_at_0002(db_at_0002)
    config = pg.alembic_config(db_at_0002)

    command.upgrade(config, "head")
    _check_backfill(db_at_0002, ids)

    command.downgrade(config, "0002")
    engine = make_engine(db_at_0002, application_name="fairq-tests", poolclass=pool.NullPool)
    try:
        with engine.begin() as conn:
            relations = set(
                conn.execute(
                    text("SELECT relname FROM pg_class WHERE relnamespace = 'public'::regnamespace")
                ).scalars()
            )
            assert not relations & {
                "company_queues",
                "claim_cursor",
                "fairq_claim_cursor_position",
                "fairq_claim_cursor_credit",
            }
            # Put the claimed tasks back, as if the upgrade had never been tried.
            conn.execute(
                text(
                    "UPDATE tasks SET status = 'pending', attempts = 0, lease_token = NULL, "
                    "locked_by = NULL, locked_at = NULL, started_at = NULL "
                    "WHERE locked_by = 'fair:1'"
                )
            )
    finally:
        engine.dispose()
    command.upgrade(config, "head")
    _check_backfill(db_at_0002, ids)


def _waiting(engine: Engine, application_name: str, event: str) -> bool:
    with engine.connect() as conn:
        return bool(
            conn.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = :name "
                    "AND wait_event_type = 'Lock' AND wait_event = :event"
                ),
                {"name": application_name, "event": event},
            ).scalar_one()
        )


def _wait_until(condition: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.mark.slow
def test_tasks_written_while_the_upgrade_runs_are_not_missed_by_the_backfill(
    db_at_0002: str,
) -> None:
    """Writers around a running upgrade: one open before it, one arriving in the middle.

    The first writer's open insert makes the upgrade wait (its ALTER TABLE needs the
    companies table), so the backfill sees that task. The second writer arrives while the
    upgrade holds its locks (paused here just before it records the new revision): its
    insert waits for the upgrade's commit, then fires the new trigger. Both companies end up
    with the right due_at, and the claim takes both tasks.
    """
    ids = _seed_at_0002(db_at_0002)
    watch = make_engine(db_at_0002, application_name="fairq-tests", poolclass=pool.NullPool)
    early = make_engine(db_at_0002, application_name="early-writer", poolclass=pool.NullPool)
    late = make_engine(db_at_0002, application_name="late-writer", poolclass=pool.NullPool)
    failures: list[BaseException] = []
    late_task: list[uuid.UUID] = []

    def upgrade() -> None:
        try:
            command.upgrade(pg.alembic_config(db_at_0002), "head")
        except BaseException as exc:  # reported by the test
            failures.append(exc)

    def write_late() -> None:
        try:
            with late.begin() as conn:
                late_task.append(
                    conn.execute(
                        text(
                            "INSERT INTO tasks (company_id, type, payload) "
                            "VALUES (:c, 'noop', '{}') RETURNING id"
                        ),
                        {"c": ids["idle"]},
                    ).scalar_one()
                )
        except BaseException as exc:  # reported by the test
            failures.append(exc)

    try:
        with watch.connect() as pause, early.connect() as writer:
            # Hold the version row, so the upgrade stops right before it records 0003.
            pause.execute(text("SELECT * FROM alembic_version FOR UPDATE"))
            early_task = writer.execute(
                text(
                    "INSERT INTO tasks (company_id, type, payload) "
                    "VALUES (:c, 'noop', '{}') RETURNING id"
                ),
                {"c": ids["busy"]},
            ).scalar_one()
            upgrader = threading.Thread(target=upgrade, daemon=True)
            upgrader.start()
            _wait_until(lambda: _waiting(watch, "fairq-migrate", "relation"), "the upgrade waits")
            writer.commit()
            _wait_until(
                lambda: _waiting(watch, "fairq-migrate", "transactionid"),
                "the upgrade to reach the version update",
            )
            late_writer = threading.Thread(target=write_late, daemon=True)
            late_writer.start()
            _wait_until(lambda: _waiting(watch, "late-writer", "relation"), "the late writer")
            pause.rollback()
            upgrader.join(30)
            late_writer.join(30)
        assert not failures, failures
        assert late_task
        with make_sessionmaker(watch)() as session:
            for company, task_id in ((ids["busy"], early_task), (ids["idle"], late_task[0])):
                run_after = session.execute(
                    text("SELECT run_after FROM tasks WHERE id = :id"), {"id": task_id}
                ).scalar_one()
                assert queue_state(session, company).due_at == run_after
            claimed = {t.id for t in claim_tasks(session)}
            assert {early_task, late_task[0]} <= claimed
    finally:
        for engine in (watch, early, late):
            engine.dispose()


def test_a_companys_weight_and_limit_reach_the_claim_when_changed(db_session: Session) -> None:
    """The claim reads weight and max_in_flight from company_queues, copied by triggers."""
    company = insert_company(db_session, "copied").id
    copies = text("SELECT weight, max_in_flight FROM company_queues WHERE company_id = :c")
    assert db_session.execute(copies, {"c": company}).one() == (1, None)

    db_session.execute(
        text("UPDATE companies SET weight = 7, max_in_flight = 2 WHERE id = :c"), {"c": company}
    )
    assert db_session.execute(copies, {"c": company}).one() == (7, 2)

    for _ in range(5):
        insert_task(db_session, company)
    assert len(claim(db_session)) == 2  # its limit, read through the copy
