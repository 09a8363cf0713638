"""The claim floor (decision 0012; db/sql/tasks.sql, db/sql/claim.sql).

A claim reads a company's pending range from its floor, raises the floor past what it
claimed, and every way a task becomes pending below the floor lowers it again: no task is
skipped, and while a snapshot is held elsewhere a claim no longer reads the index entries of
every task claimed before it.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from db import claims, workers
from db.engine import driver_connection
from tests.factories import insert_company, insert_tasks

Floor = tuple[dt.datetime | None, uuid.UUID | None]


def claim(session: Session, batch_size: int) -> list[claims.ClaimedTask]:
    """One committed claim, as a worker makes it."""
    return claims.claim(
        driver_connection(session, transaction=False),
        worker_id="floor:1",
        batch_size=batch_size,
        commit=session.commit,
    )


def floor_of(session: Session, company: uuid.UUID) -> Floor:
    """The company's claim floor, read fresh."""
    row = session.execute(
        text("SELECT claim_floor_at, claim_floor_id FROM company_queues WHERE company_id = :c"),
        {"c": company},
    ).one()
    session.commit()
    return row.claim_floor_at, row.claim_floor_id


def key_of(session: Session, task: uuid.UUID) -> Floor:
    """A task's place in its company's line: (run_after, id)."""
    run_after: dt.datetime = session.execute(
        text("SELECT run_after FROM tasks WHERE id = :id"), {"id": task}
    ).scalar_one()
    session.commit()
    return run_after, task


@pytest.fixture
def session(fresh_engine: Engine) -> Iterator[Session]:
    with Session(fresh_engine) as session:
        yield session


def test_a_claim_raises_the_floor_of_a_company_to_its_earliest_pending_task(
    fresh_engine: Engine, session: Session
) -> None:
    """40 tasks of 100 claimed (at least 32: the floor is raised for sure): it is the 41st's."""
    company = insert_company(fresh_engine).id
    ids = insert_tasks(fresh_engine, company, 100)
    assert floor_of(session, company) == (None, None)
    assert [t.id for t in claim(session, 40)] == ids[:40]
    assert floor_of(session, company) == key_of(session, ids[40])


def test_a_drained_company_has_its_floor_at_the_end_and_a_new_task_lowers_it(
    fresh_engine: Engine, session: Session
) -> None:
    company = insert_company(fresh_engine).id
    insert_tasks(fresh_engine, company, 40)
    assert len(claim(session, 100)) == 40
    assert floor_of(session, company) == (
        dt.datetime(9999, 12, 30, tzinfo=dt.UTC),
        uuid.UUID("ffffffff-ffff-ffff-ffff-ffffffffffff"),
    )
    [new] = insert_tasks(fresh_engine, company, 1)
    assert floor_of(session, company) == key_of(session, new)
    assert [t.id for t in claim(session, 10)] == [new]


def _release(session: Session, lease: claims.ClaimedTask) -> None:
    assert claims.release_tasks(driver_connection(session, transaction=False), [lease]) == []


def _expire(session: Session, lease: claims.ClaimedTask) -> None:
    session.execute(
        text("UPDATE tasks SET locked_at = now() - interval '1 hour' WHERE id = :id"),
        {"id": lease.id},
    )
    taken = workers.take_back_leases(driver_connection(session), stale_after=60)
    assert [e.id for e in taken] == [lease.id]


@pytest.mark.parametrize("make_pending", [_release, _expire], ids=["release", "expired-lease"])
def test_a_task_made_pending_below_the_floor_lowers_it_and_is_claimed_first(
    fresh_engine: Engine,
    session: Session,
    make_pending: Callable[[Session, claims.ClaimedTask], None],
) -> None:
    """A released or expired task keeps (or goes back to) an early place in line: below the
    floor the claims before raised. Its trigger lowers the floor; the next claim takes it."""
    company = insert_company(fresh_engine).id
    ids = insert_tasks(fresh_engine, company, 100)
    first, *_ = claim(session, 40)
    assert first.id == ids[0]
    assert floor_of(session, company) == key_of(session, ids[40])
    make_pending(session, first)
    session.commit()
    assert floor_of(session, company) == key_of(session, ids[0])
    assert [t.id for t in claim(session, 2)] == [ids[0], ids[40]]


def test_a_task_inserted_below_the_floor_lowers_it_and_is_claimed_first(
    fresh_engine: Engine, session: Session
) -> None:
    """An insert whose run_after is earlier than the floor (plain SQL can write one)."""
    company = insert_company(fresh_engine).id
    ids = insert_tasks(fresh_engine, company, 100)
    claim(session, 40)
    early = session.execute(
        text(
            "INSERT INTO tasks (company_id, type, payload, run_after) "
            "VALUES (:c, 'noop', '{}', now() - interval '1 day') RETURNING id"
        ),
        {"c": company},
    ).scalar_one()
    session.commit()
    assert floor_of(session, company) == key_of(session, early)
    assert [t.id for t in claim(session, 2)] == [early, ids[40]]


def _index_entries_read(session: Session) -> int:
    """Entries of the pending index this transaction has read so far."""
    read: int = session.execute(
        text(
            "SELECT pg_stat_get_xact_tuples_returned("
            "'ix_tasks_pending_company_run_after'::regclass)"
        )
    ).scalar_one()
    return read


def test_while_a_snapshot_is_held_a_claim_reads_the_pending_index_from_the_floor(
    fresh_engine: Engine, fresh_db_url: str, session: Session
) -> None:
    """1,500 of 2,000 tasks claimed and their index entries kept by a held snapshot: the next
    claim of 100 reads a few hundred entries, not every one of the 1,500 again; the control
    (the floor cleared, as before migration 0015) reads them all."""
    company = insert_company(fresh_engine).id
    insert_tasks(fresh_engine, company, 2000)
    url = fresh_db_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(url) as holder:
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM tasks").fetchone()  # the snapshot is taken
        for _ in range(15):
            claim(session, 100)

        def entries_read_by_a_claim() -> int:
            before = _index_entries_read(session)
            assert (
                len(
                    claims.claim(
                        driver_connection(session, transaction=False),
                        worker_id="floor:1",
                        batch_size=100,
                    )
                )
                == 100
            )
            read = _index_entries_read(session) - before
            session.rollback()
            return read

        with_floor = entries_read_by_a_claim()
        session.execute(
            text("UPDATE company_queues SET claim_floor_at = NULL, claim_floor_id = NULL")
        )
        session.commit()
        without_floor = entries_read_by_a_claim()
        holder.rollback()
    assert with_floor < 400, with_floor
    assert without_floor > 1500, without_floor


def _processing_entries_read(session: Session) -> int:
    """Entries of the two processing indexes this transaction has read so far."""
    read: int = session.execute(
        text(
            "SELECT pg_stat_get_xact_tuples_returned('ix_tasks_processing_locked_at'::regclass)"
            " + pg_stat_get_xact_tuples_returned("
            "'ix_tasks_processing_company_locked_at'::regclass)"
        )
    ).scalar_one()
    return read


def test_a_completion_finds_its_leases_by_id_not_through_a_processing_index(
    fresh_engine: Engine, session: Session
) -> None:
    """With the processing indexes' literal predicate in its WHERE, the planner scanned one and
    filtered it by id: a scan that grew with every task finished while a snapshot was held."""
    company = insert_company(fresh_engine).id
    insert_tasks(fresh_engine, company, 300)
    first = list(claim(session, 100))
    claims.complete_tasks(driver_connection(session, transaction=False), first)
    session.commit()
    leases = list(claim(session, 100))
    session.execute(text("ANALYZE tasks"))
    session.commit()
    before = _processing_entries_read(session)
    assert claims.complete_tasks(driver_connection(session, transaction=False), leases) == []
    assert claims.release_tasks(driver_connection(session, transaction=False), leases) == leases
    assert _processing_entries_read(session) == before
    session.commit()
