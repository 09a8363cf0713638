"""The claim in the server (db/sql/claim.sql) under cancels, big batches and bad input.

Found by trying to break it: a cancel landing while a failed claim unwound left the
reservation's session-level lock held (now a transaction lock in a subtransaction that is
always rolled back), a batch above the promotion limit came back short, and a NULL worker id
was leased to no one.
"""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from sqlalchemy import Engine

from tests.factories import insert_company, insert_tasks
from tests.pg import libpq

RESERVATION_LOCK = 28817553143984755  # "fairqrs", db/sql/claim.sql
_RESERVATION_HELD = (
    "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
    "AND classid = 6709609 AND objid = 1920037491 AND objsubid = 1 "
    "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)


# pg_lock_status() rather than the pg_locks view: the view is locked in the test below.
_RESERVATION_OF = (
    "SELECT l.granted FROM pg_lock_status() l WHERE l.pid = %s AND l.locktype = 'advisory' "
    "AND l.classid = 6709609 AND l.objid = 1920037491 AND l.objsubid = 1"
)


_WAITING_FOR_A_LOCK = (
    "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock' "
    "AND wait_event = 'relation'"
)


def _wait_for(probe: psycopg.Connection[tuple[object, ...]], sql: str, pid: int) -> None:
    deadline = time.monotonic() + 10
    while not probe.execute(sql, (pid,)).fetchone():
        assert time.monotonic() < deadline, sql
        time.sleep(0.005)


def test_a_burst_of_cancels_on_a_claim_leaves_no_reservation_lock_behind(
    fresh_engine: Engine, fresh_db_url: str
) -> None:
    """The exception handler's unlock is itself interruptible: a second cancel (a client's
    cancel on top of a statement timeout, an operator's watchdog, a double Ctrl-C) that lands
    while the handler runs leaves the session-level reservation lock held by an idle
    session. Every other claimer of the cluster then waits on it, while that session's own
    later claims take it reentrantly and never release it. Probabilistic (a burst of cancels
    per trial; here a trial leaks within the first 25); the test below is deterministic."""
    company = insert_company(fresh_engine)
    insert_tasks(fresh_engine, company.id, 20)
    url = libpq(fresh_db_url)
    with psycopg.connect(url, autocommit=True) as observer:
        for trial in range(60):
            with (
                psycopg.connect(url) as holder,
                psycopg.connect(url, autocommit=True) as victim,
            ):
                # The claim takes the reservation, then waits inside it for this table.
                holder.execute("LOCK TABLE company_queues IN ACCESS EXCLUSIVE MODE")
                pid = victim.info.backend_pid
                errors: list[BaseException] = []

                def claim(
                    victim: psycopg.Connection[tuple[object, ...]] = victim,
                    errors: list[BaseException] = errors,
                ) -> None:
                    try:
                        victim.execute("SELECT * FROM fairq_claim('review', 1)").fetchall()
                    except psycopg.Error as exc:
                        errors.append(exc)

                thread = threading.Thread(target=claim)
                thread.start()
                # Waiting for the table: today inside its reservation.
                _wait_for(observer, _WAITING_FOR_A_LOCK, pid)
                # A burst of cancels: the first interrupts the wait, later ones the handler.
                observer.execute(
                    "SELECT count(*) FROM (SELECT pg_cancel_backend(%s) "
                    "FROM generate_series(1, 50000)) c",
                    (pid,),
                )
                thread.join(timeout=10)
                holder.rollback()
                assert errors, "the claim was not cancelled"
                left = observer.execute(_RESERVATION_HELD).fetchall()
                state = observer.execute(
                    "SELECT state FROM pg_stat_activity WHERE pid = %s", (pid,)
                ).fetchone()
                assert left == [], (
                    f"trial {trial}: session {pid} ({state}) still holds the reservation lock "
                    "after its claim was cancelled; every other claimer now waits on it"
                )


def test_a_second_cancel_while_a_failed_claim_unwinds_leaves_no_reservation_lock(
    fresh_engine: Engine, fresh_db_url: str
) -> None:
    """Deterministic form of the test above. A handler that released a session-level lock
    after an error would be ordinary SQL (a read of pg_locks, then the unlock), and a second
    interrupt while it ran would abort it before the unlock. Here anything that reads
    pg_locks while unwinding is held (the view locked by another session) and cancelled
    once more: the claim fails and its session holds nothing, so other claims go on."""
    company = insert_company(fresh_engine)
    insert_tasks(fresh_engine, company.id, 3)
    url = libpq(fresh_db_url)
    with (
        psycopg.connect(url, autocommit=True) as observer,
        psycopg.connect(url) as holder,
        psycopg.connect(url, autocommit=True) as victim,
        psycopg.connect(url, autocommit=True) as other,
    ):
        holder.execute("LOCK TABLE company_queues IN ACCESS EXCLUSIVE MODE")
        holder.execute("LOCK TABLE pg_catalog.pg_locks IN ACCESS EXCLUSIVE MODE")
        pid = victim.info.backend_pid
        errors: list[BaseException] = []

        def claim() -> None:
            try:
                victim.execute("SELECT * FROM fairq_claim('review', 1)").fetchall()
            except psycopg.Error as exc:
                errors.append(exc)

        thread = threading.Thread(target=claim)
        thread.start()
        # 1. The claim waits for company_queues: today inside its reservation.
        _wait_for(observer, _WAITING_FOR_A_LOCK, pid)
        observer.execute("SELECT pg_cancel_backend(%s)", (pid,))
        # 2. Its exception handler runs, and waits for the pg_locks view (a handler that
        # does not read it has ended the claim by then).
        deadline = time.monotonic() + 10
        while thread.is_alive() and time.monotonic() < deadline:
            if observer.execute(
                "SELECT 1 FROM pg_lock_status() l WHERE l.pid = %s AND NOT l.granted "
                "AND l.relation = 'pg_catalog.pg_locks'::regclass",
                (pid,),
            ).fetchone():
                observer.execute("SELECT pg_cancel_backend(%s)", (pid,))
                break
            time.sleep(0.005)
        thread.join(timeout=10)
        holder.rollback()
        assert errors, "the claim was not cancelled"
        left = observer.execute(_RESERVATION_OF, (pid,)).fetchall()
        other.execute("SET lock_timeout = '2s'")
        try:
            other.execute("SELECT * FROM fairq_claim('other', 1)").fetchall()
            blocked = ""
        except psycopg.errors.LockNotAvailable:
            blocked = "; another claimer's claim now times out waiting for it"
        assert left == [], f"the failed claim's idle session still holds the reservation{blocked}"


def test_a_batch_larger_than_the_promotion_limit_is_not_short_while_due_companies_wait(
    fresh_engine: Engine, fresh_db_url: str
) -> None:
    """WORKER_BATCH_SIZE allows up to 10,000. With companies that have a max_in_flight, a
    round promotes at most 1,000 waiting companies (PROMOTE_LIMIT); when every share of that
    round is met the function stops (`IF got = share.tasks THEN EXIT`) although the batch is
    not full and hundreds of due companies, whose work nobody holds, were never promoted."""
    with psycopg.connect(libpq(fresh_db_url), autocommit=True) as sql:
        sql.execute(
            "INSERT INTO companies (name, max_in_flight) "
            "SELECT 'c' || g, 1 FROM generate_series(1, 1500) g"
        )
        sql.execute(
            "INSERT INTO tasks (company_id, type, payload) "
            "SELECT id, 'noop', '{}' FROM companies, generate_series(1, 2)"
        )
        claimed = sql.execute("SELECT * FROM fairq_claim('review', 1200)").fetchall()
        allowed_left = sql.execute(
            "SELECT count(DISTINCT t.company_id) FROM tasks t "
            "WHERE t.status = 'pending' AND NOT EXISTS ("
            "  SELECT 1 FROM tasks p WHERE p.company_id = t.company_id "
            "  AND p.status = 'processing')"
        ).fetchone()[0]  # type: ignore[index]
    assert len(claimed) == 1200, (
        f"a batch of 1200 came back with {len(claimed)} while {allowed_left} companies under "
        "their limit still had a runnable task and no other claim was in flight"
    )


def test_a_claim_with_a_null_worker_id_is_refused_not_leased_to_no_one(
    fresh_engine: Engine, fresh_db_url: str
) -> None:
    """A lease must name its holder: `locked_by` NULL is one no worker's heartbeat keeps,
    and a round's shortfall is read back from the leases of its worker id."""
    company = insert_company(fresh_engine)
    insert_tasks(fresh_engine, company.id, 3)
    with psycopg.connect(libpq(fresh_db_url), autocommit=True) as sql:
        with pytest.raises(psycopg.errors.NullValueNotAllowed, match="worker_id"):
            sql.execute("SELECT * FROM fairq_claim(NULL, 2)")
        leased = sql.execute("SELECT count(*) FROM tasks WHERE status = 'processing'").fetchone()
    assert leased == (0,)


@pytest.mark.parametrize("batch_size", [0, -1, None])
def test_a_claim_of_no_tasks_or_a_negative_number_is_refused(
    fresh_db_url: str, batch_size: int | None
) -> None:
    with (
        psycopg.connect(libpq(fresh_db_url), autocommit=True) as sql,
        pytest.raises(psycopg.errors.InvalidParameterValue, match="batch_size must be"),
    ):
        sql.execute("SELECT * FROM fairq_claim('w', %s)", (batch_size,))
