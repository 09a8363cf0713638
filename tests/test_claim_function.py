"""The claim in the server (`fairq_claim`, `fairq_allocate`; db/sql/claim.sql), many at once.

The allocation is checked against its reference model, `db.fair_share.allocate`, on random
rings. The guarantees are checked with 8 or 16 claimers in threads, each on a connection of
its own to a fresh database, claiming through `db.claims.claim` as workers do: no task twice,
no batch short while allowed work exists, `max_in_flight` never exceeded, a committed pause
obeyed, and the fairness bound of decision 0007.
"""

from __future__ import annotations

import math
import random
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from db import claims, companies, fair_share
from db.engine import driver_connection
from db.fair_share import Contender
from tests.factories import insert_company, insert_tasks

SQL_FILE = Path(__file__).resolve().parent.parent / "db" / "sql" / "claim.sql"

PROPERTIES = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=400,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


# -- the allocation against its model ------------------------------------------------------


@pytest.fixture(scope="module")
def sql(main_db_url: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """A psycopg connection to the migrated database, in autocommit (reads only)."""
    url = main_db_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(url, autocommit=True) as connection:
        yield connection


@st.composite
def rings(draw: st.DrawFn) -> tuple[list[Contender], int, int]:
    """Contenders in ring order, the slots to share, and the first one's credit."""
    n = draw(st.integers(0, 12))
    positions = sorted(draw(st.sets(st.integers(1, 10_000), min_size=n, max_size=n)))
    contenders = [
        Contender(
            uuid.UUID(int=i + 1),
            position,
            draw(st.integers(1, 20)),
            draw(st.one_of(st.none(), st.integers(0, 12))),
        )
        for i, position in enumerate(positions)
    ]
    slots = draw(st.integers(1, 200))
    credit = draw(st.integers(0, contenders[0].weight - 1)) if contenders else 0
    return contenders, slots, credit


@PROPERTIES
@given(case=rings())
def test_the_servers_allocation_is_the_reference_models(
    sql: psycopg.Connection[tuple[object, ...]], case: tuple[list[Contender], int, int]
) -> None:
    contenders, slots, credit = case
    model = fair_share.allocate(contenders, slots, credit)
    row = sql.execute(
        "SELECT * FROM fairq_allocate(%s::bigint[], %s::int[], %s::int[], %s, %s)",
        (
            [c.ring_position for c in contenders],
            [c.weight for c in contenders],
            [c.headroom for c in contenders],
            slots,
            credit,
        ),
    ).fetchone()
    assert row is not None
    tasks, turns, first_turns, cursor_position, cursor_credit = row
    assert tasks == model.tasks
    assert turns == model.turns
    assert first_turns == model.first_turns
    if contenders:
        assert (cursor_position, cursor_credit) == (
            model.cursor.ring_position,
            model.cursor.credit,
        )


# -- many claimers at once -----------------------------------------------------------------


class Claimers:
    """`count` threads, each claiming through `claims.claim` on a session of its own."""

    def __init__(self, engine: Engine, count: int) -> None:
        self.engine = engine
        self.count = count
        self.errors: list[BaseException] = []

    def run(self, body: Callable[[int, Session], object]) -> None:
        """Run `body(index, session)` in every thread at once; re-raise the first error."""
        start = threading.Barrier(self.count)

        def thread(index: int) -> None:
            try:
                with Session(self.engine) as session:
                    start.wait(timeout=30)
                    body(index, session)
            except BaseException as exc:  # re-raised in the test's thread
                self.errors.append(exc)

        threads = [threading.Thread(target=thread, args=(i,)) for i in range(self.count)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads), "a claimer hung"
        if self.errors:
            raise self.errors[0]


def claim(session: Session, batch_size: int, worker: str = "t") -> list[claims.ClaimedTask]:
    """One committed claim, as a worker makes it."""
    return claims.claim(
        driver_connection(session, transaction=False),
        worker_id=worker,
        batch_size=batch_size,
        commit=session.commit,
    )


def promote_all(engine: Engine) -> None:
    """Bring every company with due work into the ring, as the first claim would.

    The claim promotes in its own transaction; until it commits, other claimers do not see
    those companies (decision 0007, "Work conservation"). Tests of steady state start after.
    """
    with Session(engine) as session:
        session.execute(
            text(
                "UPDATE company_queues SET ready = true, "
                "ring_position = nextval('company_ring_positions') "
                "WHERE NOT ready AND due_at <= now() AND NOT paused"
            )
        )
        session.commit()


def processing_by_company(engine: Engine) -> Counter[uuid.UUID]:
    """Tasks claimed so far (processing or finished), per company, in one snapshot."""
    with engine.connect() as connection:
        rows = connection.execute(
            text("SELECT company_id, count(*) FROM tasks WHERE attempts > 0 GROUP BY company_id")
        ).all()
    return Counter(dict(rows))


def test_sixteen_claimers_never_claim_a_task_twice_nor_come_back_short(
    fresh_engine: Engine,
) -> None:
    """Exactly as many runnable tasks as 16 x 12 claims of 10 want: every batch is full.

    Companies of very different backlogs run out at different times, so claims meet short
    companies, further rounds and settles while others claim beside them.
    """
    claimers, claims, batch = 16, 12, 10
    total = claimers * claims * batch
    rng = random.Random(7)
    sizes = [rng.randint(1, 40) for _ in range(30)]
    sizes[-1] += total - sum(sizes)
    assert sizes[-1] > 0
    for i, size in enumerate(sizes):
        insert_tasks(fresh_engine, insert_company(fresh_engine, name=f"c{i}").id, size)
    promote_all(fresh_engine)
    batches: list[list[uuid.UUID]] = []
    lock = threading.Lock()

    def body(index: int, session: Session) -> None:
        for _ in range(claims):
            got = [task.id for task in claim(session, batch, f"w{index}")]
            with lock:
                batches.append(got)

    Claimers(fresh_engine, claimers).run(body)
    assert [len(b) for b in batches] == [batch] * (claimers * claims)
    ids = [task_id for b in batches for task_id in b]
    assert len(set(ids)) == len(ids) == total
    with fresh_engine.connect() as connection:
        states = connection.execute(
            text("SELECT status, attempts, count(*) FROM tasks GROUP BY 1, 2")
        ).all()
    assert states == [("processing", 1, total)]


def test_sixteen_claimers_keep_equal_weights_within_the_bound_of_decision_0007(
    fresh_engine: Engine,
) -> None:
    """Equal weights, all backlogged: at rest no company is two tasks ahead of another;
    while claims are in flight, at most one batch per concurrent claimer apart.

    A sampler reads the committed counts throughout. The bound: the reservations are one
    deficit round robin sequence (a prefix of it is within 1), and what is missing from a
    snapshot is at most the claims in flight, each giving a company ceil(batch / companies).
    """
    claimers, claims, batch, n = 16, 15, 10, 50
    for i in range(n):
        insert_tasks(fresh_engine, insert_company(fresh_engine, name=f"c{i}").id, 80)
    promote_all(fresh_engine)
    bound = 1 + claimers * math.ceil(batch / n)
    spreads: list[int] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            counts = processing_by_company(fresh_engine)
            values = [counts.get(c, 0) for c in companies_ids]
            spreads.append(max(values) - min(values))

    with fresh_engine.connect() as connection:
        companies_ids = [row[0] for row in connection.execute(text("SELECT id FROM companies"))]
    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        Claimers(fresh_engine, claimers).run(
            lambda index, session: [claim(session, batch, f"w{index}") for _ in range(claims)]
        )
    finally:
        done.set()
        sampler.join()
    final = processing_by_company(fresh_engine)
    assert sum(final.values()) == claimers * claims * batch
    assert max(final.values()) - min(final.values()) <= 1, final
    assert spreads
    assert max(spreads) <= bound, (max(spreads), bound)


def test_eight_claimers_give_weighted_shares_within_five_percent_over_20000_tasks(
    fresh_engine: Engine,
) -> None:
    """Weights 1..8, 8 claimers, 20,000 tasks: each share within 5% of weight / sum of weights,
    and Jain's index of the weight-normalized shares at least 0.99."""
    claimers, claims, batch = 8, 50, 50
    total = claimers * claims * batch
    weights = list(range(1, 9))
    ids = []
    for weight in weights:
        company = insert_company(fresh_engine, name=f"w{weight}")
        with Session(fresh_engine) as session:
            companies.update_company_limits(
                driver_connection(session, transaction=False), company.id, weight=weight
            )
            session.commit()
        # More than its share: nobody runs out, so the shares are the weights'.
        insert_tasks(fresh_engine, company.id, total * weight // sum(weights) + 2 * batch)
        ids.append(company.id)
    promote_all(fresh_engine)
    Claimers(fresh_engine, claimers).run(
        lambda index, session: [claim(session, batch, f"w{index}") for _ in range(claims)]
    )
    counts = processing_by_company(fresh_engine)
    assert sum(counts.values()) == total
    normalized = []
    for company_id, weight in zip(ids, weights, strict=True):
        ideal = total * weight / sum(weights)
        assert abs(counts[company_id] - ideal) <= 0.05 * ideal, (weight, counts[company_id], ideal)
        normalized.append(counts[company_id] / weight)
    jain = sum(normalized) ** 2 / (len(normalized) * sum(x * x for x in normalized))
    print(f"Jain's index of the weight-normalized shares: {jain:.5f}")
    assert jain >= 0.99


def test_sixteen_claimers_never_exceed_max_in_flight(fresh_engine: Engine) -> None:
    """A company limited to 3 leases among busy ones; claimers complete what they claimed a
    moment later, so its count goes up and down. Sampled throughout, it never passes 3."""
    claimers, rounds, batch, limit = 16, 20, 4, 3
    limited = insert_company(fresh_engine, name="limited")
    with Session(fresh_engine) as session:
        companies.update_company_limits(
            driver_connection(session, transaction=False), limited.id, max_in_flight=limit
        )
        session.commit()
    insert_tasks(fresh_engine, limited.id, 400)
    for i in range(5):
        insert_tasks(fresh_engine, insert_company(fresh_engine, name=f"c{i}").id, 400)
    promote_all(fresh_engine)
    samples: list[int] = []
    done = threading.Event()

    def sample() -> None:
        with fresh_engine.connect() as connection:
            while not done.is_set():
                samples.append(
                    connection.execute(
                        text(
                            "SELECT count(*) FROM tasks "
                            "WHERE company_id = :c AND status = 'processing'"
                        ),
                        {"c": limited.id},
                    ).scalar_one()
                )
                connection.commit()

    def body(index: int, session: Session) -> None:
        rng = random.Random(index)
        for _ in range(rounds):
            tasks = claim(session, batch, f"w{index}")
            threading.Event().wait(rng.uniform(0, 0.01))
            claims.complete_tasks(driver_connection(session, transaction=False), list(tasks))
            session.commit()

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        Claimers(fresh_engine, claimers).run(body)
    finally:
        done.set()
        sampler.join()
    assert samples
    assert max(samples) <= limit, max(samples)
    with fresh_engine.connect() as connection:
        served = connection.execute(
            text("SELECT count(*) FROM tasks WHERE company_id = :c AND attempts > 0"),
            {"c": limited.id},
        ).scalar_one()
    assert served > limit  # it was served, again and again, not starved by its limit


def test_once_a_pause_commits_sixteen_claimers_take_none_of_its_tasks(
    fresh_engine: Engine,
) -> None:
    claimers, claims, batch = 16, 12, 5
    paused = insert_company(fresh_engine, name="paused")
    insert_tasks(fresh_engine, paused.id, 600)
    for i in range(9):
        insert_tasks(fresh_engine, insert_company(fresh_engine, name=f"c{i}").id, 600)
    promote_all(fresh_engine)
    at_pause: list[int] = []
    started = threading.Barrier(2)

    def pause_midway() -> None:
        started.wait(timeout=30)
        threading.Event().wait(0.05)
        with Session(fresh_engine) as session:
            companies.pause_company(driver_connection(session, transaction=False), paused.id)
            session.commit()
        at_pause.append(processing_by_company(fresh_engine)[paused.id])

    pauser = threading.Thread(target=pause_midway)
    pauser.start()

    def body(index: int, session: Session) -> None:
        if index == 0:
            started.wait(timeout=30)
        for _ in range(claims):
            claim(session, batch, f"w{index}")

    Claimers(fresh_engine, claimers).run(body)
    pauser.join()
    assert at_pause, "the pause did not run"
    after = processing_by_company(fresh_engine)
    assert after[paused.id] == at_pause[0]
    assert sum(after.values()) > after[paused.id]  # the others went on being claimed


def test_a_claim_in_autocommit_is_one_round_trip_and_leaves_no_lock_behind(
    fresh_engine: Engine,
) -> None:
    """The statement is its own transaction: its batch is committed and every lock it took,
    the reservation's included, is gone when it returns."""
    company = insert_company(fresh_engine)
    insert_tasks(fresh_engine, company.id, 3)
    with fresh_engine.connect() as connection:
        connection.execution_options(isolation_level="AUTOCOMMIT")
        with Session(bind=connection) as session:
            assert (
                len(
                    claims.claim(
                        driver_connection(session, transaction=False), worker_id="t", batch_size=2
                    )
                )
                == 2
            )
            pid = connection.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
            with fresh_engine.connect() as other:
                locks = other.execute(
                    text(
                        "SELECT count(*) FROM pg_locks WHERE pid = :pid AND locktype = 'advisory'"
                    ),
                    {"pid": pid},
                ).scalar_one()
                claimed = other.execute(
                    text("SELECT count(*) FROM tasks WHERE status = 'processing'")
                ).scalar_one()
    assert locks == 0
    assert claimed == 2


RESERVATION_LOCK = 28817553143984755  # "fairqrs", db/sql/claim.sql


@pytest.mark.parametrize("where", ["waiting for it", "holding it"])
def test_a_claim_cancelled_in_its_reservation_leaves_no_lock_behind(
    fresh_engine: Engine, where: str
) -> None:
    """A statement timeout while the claim waits for the reservation's lock,
    or while it holds it (here: waiting for a table lock inside), leaves no lock: the next
    claim, on that connection or another, goes through."""
    company = insert_company(fresh_engine)
    insert_tasks(fresh_engine, company.id, 3)
    with fresh_engine.connect() as holder, fresh_engine.connect() as claimer:
        if where == "waiting for it":
            holder.exec_driver_sql(f"SELECT pg_advisory_lock({RESERVATION_LOCK})")
        else:
            holder.exec_driver_sql("LOCK TABLE company_queues IN ACCESS EXCLUSIVE MODE")
        claimer.exec_driver_sql("SET statement_timeout = '300ms'")
        with pytest.raises(Exception, match="statement timeout"), Session(bind=claimer) as s:
            claims.claim(driver_connection(s, transaction=False), worker_id="t", batch_size=1)
        claimer.rollback()
        if where == "waiting for it":
            holder.exec_driver_sql(f"SELECT pg_advisory_unlock({RESERVATION_LOCK})")
        holder.commit()
        assert holder.exec_driver_sql(
            f"SELECT pg_try_advisory_lock({RESERVATION_LOCK})"
        ).scalar_one()
        holder.exec_driver_sql(f"SELECT pg_advisory_unlock({RESERVATION_LOCK})")
        holder.commit()
        claimer.exec_driver_sql("SET statement_timeout = 0")
        with Session(bind=claimer) as s:
            assert (
                len(
                    claims.claim(
                        driver_connection(s, transaction=False), worker_id="t", batch_size=1
                    )
                )
                == 1
            )
        claimer.commit()  # the transaction the session joined: its shared lock goes with it
        held = claimer.exec_driver_sql(
            "SELECT objid, mode, granted FROM pg_locks "
            "WHERE pid = pg_backend_pid() AND locktype = 'advisory'"
        ).all()
    assert held == []


def test_a_lease_starts_when_the_claim_takes_the_row_not_before_its_waits(
    fresh_engine: Engine,
) -> None:
    """A claim that waited a second for a pause's lock starts its leases after the wait
    (PL/pgSQL's statement_timestamp() is the caller's statement start, before it)."""
    company = insert_company(fresh_engine)
    insert_tasks(fresh_engine, company.id, 1)
    with fresh_engine.connect() as holder:
        holder.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": claims.CLAIM_LOCK_KEY})
        claimed: list[claims.ClaimedTask] = []
        thread = threading.Thread(
            target=lambda: Claimers(fresh_engine, 1).run(
                lambda _, session: claimed.extend(claim(session, 1))
            )
        )
        thread.start()
        threading.Event().wait(1.0)
        released_at = holder.execute(text("SELECT clock_timestamp()")).scalar_one()
        holder.rollback()
        thread.join()
    assert len(claimed) == 1
    with fresh_engine.connect() as connection:
        locked_at = connection.execute(
            text("SELECT locked_at FROM tasks WHERE id = :id"), {"id": claimed[0].id}
        ).scalar_one()
    assert locked_at >= released_at


def test_a_claim_outside_read_committed_is_refused(fresh_engine: Engine) -> None:
    """Its lease counts under a limit's lock need a snapshot taken after the lock."""
    company = insert_company(fresh_engine)
    insert_tasks(fresh_engine, company.id, 1)
    with fresh_engine.connect() as connection:
        connection.execution_options(isolation_level="REPEATABLE READ")
        with (
            pytest.raises(Exception, match="runs under READ COMMITTED"),
            Session(bind=connection) as session,
        ):
            claims.claim(driver_connection(session, transaction=False), worker_id="t", batch_size=1)
