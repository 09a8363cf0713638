"""The claim (design §4): eligibility, fairness, SKIP LOCKED, EvalPlanQual, concurrency.

Weighted shares, in-flight limits, the wake-up protocol and the migration of the weighted fair
claim have their own module, `tests/test_fair_claim.py`.
"""

from __future__ import annotations

import json
import multiprocessing
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection as Pipe
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from db import queue
from db.engine import driver_connection, make_engine, make_sessionmaker
from tests import claim_plans
from tests.factories import (
    MakeCompany,
    MakeTask,
    insert_company,
    insert_delayed_tasks,
    insert_task,
    insert_tasks,
)

STALE = 300.0


def claim(session: Session, **overrides: Any) -> list[queue.ClaimedTask]:
    """Claim with test defaults (worker "test:1", batch 100), then commit."""
    params: dict[str, Any] = {"worker_id": "test:1", "batch_size": 100, **overrides}
    batch = queue.claim(session, **params)
    session.commit()
    return batch


def fetch(session: Session, task_id: uuid.UUID) -> dict[str, Any]:
    """The task row as a dict, read fresh from the database."""
    result = session.execute(text("SELECT * FROM tasks WHERE id = :id"), {"id": task_id})
    return dict(result.mappings().one())


# -- what gets claimed, and how ----------------------------------------------------------


def test_claim_moves_pending_task_to_processing_under_a_new_lease(
    db_session: Session, make_company: MakeCompany, make_task: MakeTask
) -> None:
    company = make_company()
    task = make_task(company.id, payload={"k": 1})

    [claimed] = claim(db_session, worker_id="host:42")

    stored = fetch(db_session, task.id)
    assert claimed.id == task.id
    assert claimed.company_id == company.id
    assert claimed.payload == {"k": 1}
    assert claimed.attempts == stored["attempts"] == 1
    assert claimed.max_attempts == 5
    assert claimed.lease_token == stored["lease_token"] is not None
    assert claimed.lease == queue.Lease(task.id, claimed.lease_token)
    assert stored["status"] == "processing"
    assert stored["locked_by"] == "host:42"
    assert stored["locked_at"] is not None
    assert stored["started_at"] == stored["locked_at"]
    assert stored["updated_at"] == stored["locked_at"]


def test_claim_ignores_future_terminal_and_processing_tasks(
    db_session: Session, make_company: MakeCompany, make_task: MakeTask
) -> None:
    company = make_company()
    make_task(company.id, run_after=text("now() + interval '1 minute'"))
    for status in ("completed", "failed", "cancelled"):
        make_task(company.id, status=status)
    for age in ("299 seconds", "1 hour"):  # live, and expired but not yet taken back
        make_task(
            company.id,
            status="processing",
            attempts=1,
            lease_token=uuid.uuid4(),
            locked_at=text(f"now() - interval '{age}'"),
        )
    runnable = make_task(company.id, run_after=text("now() - interval '1 second'"))

    assert [t.id for t in claim(db_session)] == [runnable.id]
    assert claim(db_session) == []


def test_an_expired_lease_is_requeued_then_claimed_keeping_started_at_and_attempts(
    db_session: Session, make_company: MakeCompany, make_task: MakeTask
) -> None:
    company = make_company()
    old_token = uuid.uuid4()
    stale = make_task(
        company.id,
        status="processing",
        attempts=2,
        lease_token=old_token,
        locked_by="dead:1",
        locked_at=text("now() - interval '301 seconds'"),
        started_at=text("now() - interval '1 hour'"),
    )
    lease_start = fetch(db_session, stale.id)["locked_at"]

    [expired] = queue.expire_leases(db_session, stale_after=STALE)
    db_session.commit()

    assert (expired.id, expired.attempts, expired.locked_by, expired.failed) == (
        stale.id, 2, "dead:1", False,
    )  # fmt: skip
    requeued = fetch(db_session, stale.id)
    assert requeued["status"] == "pending"
    assert requeued["attempts"] == 2
    # Waiting since its holder was last heard of: first in its company's line.
    assert requeued["run_after"] == lease_start
    assert requeued["lease_token"] is requeued["locked_by"] is requeued["locked_at"] is None

    [claimed] = claim(db_session, worker_id="alive:2")

    stored = fetch(db_session, stale.id)
    assert claimed.id == stale.id
    assert claimed.attempts == stored["attempts"] == 3
    assert claimed.lease_token not in (old_token, None)
    assert stored["locked_by"] == "alive:2"
    assert stored["started_at"] < stored["locked_at"]


def test_an_expired_lease_without_attempts_left_is_failed_not_claimed(
    db_session: Session, make_company: MakeCompany, make_task: MakeTask
) -> None:
    company = make_company()
    pill = make_task(
        company.id,
        status="processing",
        attempts=3,
        max_attempts=3,
        lease_token=uuid.uuid4(),
        locked_by="dead:3",
        locked_at=text("now() - interval '1 hour'"),
    )

    [expired] = queue.expire_leases(db_session, stale_after=STALE)
    db_session.commit()

    assert (expired.id, expired.failed) == (pill.id, True)
    stored = fetch(db_session, pill.id)
    assert stored["status"] == "failed"
    assert stored["last_error"] == (
        "worker lost (lease expired) after 3 attempts (last holder dead:3)"
    )
    assert claim(db_session) == []


def test_expire_leases_takes_back_at_most_limit_leases_oldest_first(
    db_session: Session, make_company: MakeCompany, make_task: MakeTask
) -> None:
    company = make_company().id
    leases = [
        make_task(
            company,
            status="processing",
            attempts=1,
            lease_token=uuid.uuid4(),
            locked_at=text(f"now() - interval '{minutes} minutes'"),
        ).id
        for minutes in (30, 20, 10)
    ]

    first = queue.expire_leases(db_session, stale_after=STALE, limit=2)

    assert {e.id for e in first} == set(leases[:2])
    assert [e.id for e in queue.expire_leases(db_session, stale_after=STALE)] == leases[2:]


def test_claim_turns_jit_off_for_its_transaction(
    db_session: Session, make_company: MakeCompany, make_task: MakeTask
) -> None:
    make_task(make_company().id)
    queue.claim(db_session, worker_id="t", batch_size=1)
    assert db_session.execute(text("SHOW jit")).scalar_one() == "off"


# -- fairness ----------------------------------------------------------------------------


def test_quiet_companies_get_into_the_first_batch_despite_a_flood(
    db_session: Session, make_company: MakeCompany
) -> None:
    """A flooder's 10,000 older tasks cannot push two quiet companies out of a batch.

    The quiet tasks are newer than every flooder task, so only the turns put them in:
    companies take turns (ring order: the one whose work came due first first), one task
    each, so the batch is every company's oldest, then every company's second, then the
    flooder alone fills the rest of the batch (work-conserving).
    """
    flooder, quiet_a, quiet_b = (make_company(n) for n in ("flooder", "quiet-a", "quiet-b"))
    flood = insert_tasks(db_session, flooder.id, 10_000, newest_age_seconds=7200)
    a1, a2 = insert_tasks(db_session, quiet_a.id, 2, newest_age_seconds=3000)  # -3001, -3000
    b1, b2 = insert_tasks(db_session, quiet_b.id, 2, newest_age_seconds=2999.5)

    batch = claim(db_session, batch_size=100)

    assert [t.id for t in batch] == [flood[0], a1, b1, flood[1], a2, b2, *flood[2:96]]


def test_a_short_batch_takes_every_company_oldest_before_anyone_second(
    db_session: Session, make_company: MakeCompany
) -> None:
    flooder, quiet_a, quiet_b = (make_company(n) for n in ("flooder", "quiet-a", "quiet-b"))
    flood = insert_tasks(db_session, flooder.id, 50, newest_age_seconds=7200)
    a1, _ = insert_tasks(db_session, quiet_a.id, 2, newest_age_seconds=60)
    b1, _ = insert_tasks(db_session, quiet_b.id, 2, newest_age_seconds=30)

    assert [t.id for t in claim(db_session, batch_size=4)] == [flood[0], a1, b1, flood[1]]


def test_a_lone_company_fills_the_whole_batch(
    db_session: Session, make_company: MakeCompany
) -> None:
    """Work-conserving: no per-company cap leaves a batch short while work is runnable."""
    only = make_company()
    tasks = insert_tasks(db_session, only.id, 130)

    assert [t.id for t in claim(db_session, batch_size=100)] == tasks[:100]
    assert [t.id for t in claim(db_session, batch_size=100)] == tasks[100:]


def test_a_claim_given_commit_ends_its_transaction_before_it_hands_out_the_batch(
    fresh_engine: Engine,
) -> None:
    """With `commit`, the claim commits after its last statement, then decodes the rows.

    The same batch in the same order as the claim its caller ends, across a short round (a
    company with less work than its share, settled) and a full one; by the time the batch
    is returned another session can take the claimers' lock and sees the batch claimed.
    """
    sessions = make_sessionmaker(fresh_engine)
    with sessions() as setup:
        for n in range(3):
            company = insert_company(setup, f"c{n}")
            insert_tasks(setup, company.id, 2 if n == 1 else 60)
    with sessions() as claimer, fresh_engine.connect() as other:
        # The reference: the same claim, rolled back.
        reference = queue.claim(claimer, worker_id="test:1", batch_size=100)
        claimer.rollback()
        commits: list[int] = []

        def commit() -> None:
            claimer.commit()
            commits.append(len(commits))

        batch = queue.claim(claimer, worker_id="test:1", batch_size=100, commit=commit)

        assert commits == [0]
        assert other.execute(
            text("SELECT pg_try_advisory_xact_lock(:key)"), {"key": queue.CLAIM_LOCK_KEY}
        ).scalar_one()
        held = other.execute(
            text("SELECT id FROM tasks WHERE status = 'processing' AND locked_by = 'test:1'")
        ).scalars()
        assert set(held) == {t.id for t in batch}
    assert len(reference) == 100
    assert batch == [
        t._replace(lease_token=b.lease_token) for t, b in zip(reference, batch, strict=True)
    ]


def test_a_retried_task_queues_behind_work_that_became_eligible_before_it(
    db_session: Session, make_company: MakeCompany, make_task: MakeTask
) -> None:
    """Within a company, eligible since orders the tasks; across companies, turns do.

    A's oldest task failed and was retried with backoff that ran out a minute ago: it has
    been eligible for a minute only, so A's two younger tasks (eligible since creation, 60
    and 30 minutes ago) go first. B's expired lease, requeued by `expire_leases`, has waited
    since its holder was last heard of 20 minutes ago, before B's pending tasks became
    eligible (10 and 5 minutes ago), so it is B's first. A's work came due first, so A's
    turn comes first.
    """
    a, b = make_company("a").id, make_company("b").id

    def ago(minutes: int) -> Any:
        return text(f"now() - interval '{minutes} minutes'")

    retried = make_task(
        a, created_at=ago(120), run_after=ago(1), attempts=1, last_error="HTTP 503"
    ).id
    a1 = make_task(a, created_at=ago(60), run_after=ago(60)).id
    a2 = make_task(a, created_at=ago(30), run_after=ago(30)).id
    b1 = make_task(b, created_at=ago(10), run_after=ago(10)).id
    b2 = make_task(b, created_at=ago(5), run_after=ago(5)).id
    stale = make_task(
        b,
        status="processing",
        attempts=1,
        lease_token=uuid.uuid4(),
        locked_at=ago(20),
        created_at=ago(90),
        run_after=ago(90),
    ).id
    assert [e.id for e in queue.expire_leases(db_session, stale_after=STALE)] == [stale]

    # Turn 1: A's a1 (eligible 60 minutes), B's requeued task (20).
    assert [t.id for t in claim(db_session, batch_size=2)] == [a1, stale]
    # Then, one task a turn: a2 (30), b1 (10), the retried task (1), b2 (5).
    assert [t.id for t in claim(db_session)] == [a2, b1, retried, b2]


# -- the plan: index ranges, never the whole backlog ---------------------------------------


def _scans_of(plan: dict[str, Any], index: str) -> list[tuple[dict[str, Any], tuple[str, ...]]]:
    """The plan nodes that scan `index`, with their ancestors' node types."""
    return [
        (node, parents)
        for node, parents in claim_plans.plan_nodes(plan["Plan"])
        if node.get("Index Name") == index
    ]


def _seq_scanned(plan: dict[str, Any]) -> set[str]:
    """The relations a plan reads by sequential scan."""
    return {
        node["Relation Name"]
        for node, _ in claim_plans.plan_nodes(plan["Plan"])
        if node["Node Type"] == "Seq Scan"
    }


def _rows_read(node: dict[str, Any]) -> float:
    """Rows a scan node produced or filtered out, over all its loops."""
    per_loop = node["Actual Rows"] + node.get("Rows Removed by Filter", 0)
    return float(per_loop * node["Actual Loops"])


def _buffers(node: dict[str, Any]) -> int:
    """Pages a node touched (cache hits and reads), over all its loops."""
    return int(node["Shared Hit Blocks"] + node["Shared Read Blocks"])


def _insert_leases(
    session: Session, company_id: uuid.UUID, count: int, *, age_seconds: float
) -> None:
    """`count` processing tasks (created 3 days ago) whose lease started `age_seconds` ago."""
    session.execute(
        text(
            "INSERT INTO tasks (company_id, type, payload, status, attempts, lease_token, "
            "locked_by, locked_at, started_at, run_after, created_at, updated_at) "
            "SELECT :company_id, 'noop', '{}', 'processing', 1, gen_random_uuid(), 'w:1', "
            "now() - make_interval(secs => :age), now() - make_interval(secs => :age), "
            "now() - interval '3 days', now() - interval '3 days', now() "
            "FROM generate_series(1, :count)"
        ),
        {"company_id": company_id, "count": count, "age": float(age_seconds)},
    )
    session.commit()


PENDING_INDEX = "ix_tasks_pending_company_run_after"
PROCESSING_INDEX = "ix_tasks_processing_company_locked_at"
RING_INDEX = "ix_company_queues_ring_position"


def test_claim_plan_reads_each_company_as_an_index_range_cut_at_its_share(
    db_session: Session, make_company: MakeCompany
) -> None:
    """Each company's tasks are one LIMITed range scan of its pending index, locked lazily.

    `_CLAIM` reads ix_tasks_pending_company_run_after with `run_after <= now()` as an index
    condition; the scan feeds LockRows and the Limit of the company's share directly (no Sort
    anywhere), so a company costs at most its share of index entries however many rows it
    has. `_CONTENDERS` walks the ring's index in order from the cursor, and counts leases
    (for a company with a limit) from the company's own range of the processing index. Like a
    live queue, each company has more finished history than pending work, some delayed work
    and some leases; statistics are fresh, so the planner has every chance to do otherwise.
    """
    for i in range(20):
        company = make_company(f"c{i}").id
        history = insert_tasks(db_session, company, 1500, newest_age_seconds=3600)
        db_session.execute(
            text("UPDATE tasks SET status = 'completed', finished_at = now() WHERE id = ANY(:ids)"),
            {"ids": history},
        )
        insert_tasks(db_session, company, 100)
        insert_delayed_tasks(db_session, company, 200)
        _insert_leases(db_session, company, 20, age_seconds=10)
    db_session.execute(text("UPDATE companies SET max_in_flight = 50 WHERE name LIKE 'c1%'"))
    db_session.execute(text("ANALYZE tasks, companies, company_queues"))
    params = claim_plans.first_round_params(db_session, 100, "plan:1")

    plan = claim_plans.explain(db_session, queue._CLAIM, params)
    scans = _scans_of(plan, PENDING_INDEX)
    assert len(scans) == 1, json.dumps(plan, indent=1)
    [(node, parents)] = scans
    assert node["Node Type"] in ("Index Scan", "Index Only Scan"), node
    assert (
        node["Index Cond"]
        == "((company_id = s.company_id) AND (run_after <= statement_timestamp()))"
    )
    # The range scan feeds the row locks and the share's LIMIT: it stops after the share.
    assert parents[-2:] == ("Limit", "LockRows"), parents
    # Nothing sorts the candidates (the top node sorts the claimed batch for handing out).
    assert "Sort" not in parents[1:], parents
    assert _seq_scanned(plan) <= {"claim_cursor"}  # one row

    plan = claim_plans.explain(db_session, queue._CONTENDERS, claim_plans.contenders_params(100))
    ring = _scans_of(plan, RING_INDEX)
    assert len(ring) == 2, json.dumps(plan, indent=1)  # the rest of the lap, the lap's start
    for node, parents in ring:
        assert node["Index Cond"].startswith("(ring_position "), node
        # Read in index order, as far as the LIMIT needs: nothing sorts the ring.
        assert parents[0] == "Limit", parents
        assert "Append" in parents, parents
        assert "Sort" not in parents, parents
    assert _seq_scanned(plan) <= {"claim_cursor"}
    leases = _scans_of(plan, PROCESSING_INDEX)
    assert leases, json.dumps(plan, indent=1)
    for node, parents in leases:
        assert node["Index Cond"].startswith("(company_id = "), node
        assert parents[-1] == "Limit", parents


BACKLOG = 20_000
LIVE_LEASES = 2_000


def test_claim_cost_does_not_grow_with_a_tenants_delayed_backlog(
    db_session: Session, make_company: MakeCompany
) -> None:
    """One tenant's 20,000 delayed tasks and 2,000 live leases are never read by a claim.

    The claim's task scans read at most the company's share of entries and touch a few pages
    per company: bounds that do not mention the backlog. Reading a company's pending tasks in
    created_at order instead, filtering eligibility row by row (the claim before migration
    0002), reads the whole backlog, which shows the workload exercises what the bound is
    about. Counts and pages, not timings: EXPLAIN (ANALYZE, BUFFERS) reports what each scan
    node read.
    """
    busy, *others = (make_company(f"c{i}").id for i in range(5))
    insert_delayed_tasks(db_session, busy, BACKLOG)
    _insert_leases(db_session, busy, LIVE_LEASES, age_seconds=10)
    for company in (busy, *others):
        insert_tasks(db_session, company, 30, newest_age_seconds=60)
    db_session.execute(text("ANALYZE tasks, companies, company_queues"))
    params = claim_plans.first_round_params(db_session, 100, "plan:1")
    assert sorted(params["shares"]) == [20] * 5

    plan = claim_plans.explain(db_session, queue._CLAIM, params, analyze=True)
    [(node, _)] = _scans_of(plan, PENDING_INDEX)
    loops = node["Actual Loops"]
    assert loops == 5, node  # once per company
    assert node.get("Rows Removed by Filter", 0) == 0, node
    assert _rows_read(node) <= 20 * loops, node
    # A btree descent plus the heap pages of at most 20 rows (the test's rows are not
    # all-visible, so an index-only scan still visits the heap): far below the ~100 index
    # and ~300 heap pages the backlog and the leases occupy.
    assert _buffers(node) <= (4 + 20) * loops, node
    assert plan["Plan"]["Actual Rows"] == 100  # every company got its share, the busy one too
    contenders = claim_plans.explain(
        db_session, queue._CONTENDERS, claim_plans.contenders_params(100), analyze=True
    )
    counted = [
        node
        for node, _ in claim_plans.plan_nodes(contenders["Plan"])
        if node.get("Relation Name") == "tasks" and node["Actual Loops"] > 0
    ]
    assert not counted, "no company has a limit: no lease is counted"

    # The control: the created_at order, on an index made for it, reads the whole backlog.
    db_session.execute(
        text(
            "CREATE INDEX ix_test_pending_created_at ON tasks (company_id, created_at) "
            "WHERE status = 'pending'"
        )
    )
    before = claim_plans.explain(db_session, _CREATED_AT_ORDER, {}, analyze=True)
    read_before = sum(
        _rows_read(node)
        for node, _ in claim_plans.plan_nodes(before["Plan"])
        if node.get("Index Name") == "ix_test_pending_created_at"
    )
    assert read_before >= BACKLOG, json.dumps(before, indent=1)


# Each company's oldest runnable tasks by created_at, eligibility filtered row by row: the
# candidate scan of the claim before migration 0002, shortened.
_CREATED_AT_ORDER = """
SELECT k.id
FROM companies c
CROSS JOIN LATERAL (
    SELECT t.id FROM tasks t
    WHERE t.company_id = c.id AND t.status = 'pending' AND t.run_after <= now()
    ORDER BY t.created_at
    LIMIT 20
) k
"""


# -- locking -----------------------------------------------------------------------------


def test_claim_skips_rows_locked_by_another_session(fresh_engine: Engine) -> None:
    sessions = make_sessionmaker(fresh_engine)
    with sessions() as setup:
        company = insert_company(setup)
        first, second, third = insert_tasks(setup, company.id, 3)
    with sessions() as holder, sessions() as claimer:
        holder.execute(text("SELECT 1 FROM tasks WHERE id = :id FOR UPDATE"), {"id": first})
        assert {t.id for t in claim(claimer)} == {second, third}
        holder.rollback()
        assert [t.id for t in claim(claimer)] == [first]


def _waiting_on_advisory_lock(engine: Engine, application_name: str) -> int:
    with engine.connect() as conn:
        count: int = conn.execute(
            text(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = :name "
                "AND wait_event_type = 'Lock' AND wait_event = 'advisory'"
            ),
            {"name": application_name},
        ).scalar_one()
        return count


def _wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


@pytest.mark.slow
def test_concurrent_claimers_are_serialized_and_get_full_batches(
    fresh_engine: Engine, fresh_db_url: str
) -> None:
    """Two claimers released at once both get full, disjoint batches (design §4 evidence).

    Without the advisory lock they would compute the same candidates and SKIP LOCKED would
    leave one of them mostly empty-handed.
    """
    sessions = make_sessionmaker(fresh_engine)
    with sessions() as setup:
        for i in range(30):
            insert_tasks(setup, insert_company(setup, f"c{i}").id, 10)
    claimers = make_engine(fresh_db_url, application_name="serialized-claimer")
    results: list[list[queue.ClaimedTask]] = []
    try:
        with sessions() as holder:
            holder.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": queue.CLAIM_LOCK_KEY})

            def run() -> None:
                with make_sessionmaker(claimers)() as session:
                    results.append(claim(session, batch_size=100))

            threads = [threading.Thread(target=run) for _ in range(2)]
            for thread in threads:
                thread.start()
            _wait_until(lambda: _waiting_on_advisory_lock(fresh_engine, "serialized-claimer") == 2)
            holder.rollback()
            for thread in threads:
                thread.join(10)
    finally:
        claimers.dispose()
    assert [len(r) for r in results] == [100, 100]
    assert not {t.id for t in results[0]} & {t.id for t in results[1]}


# -- the stale-snapshot race (EvalPlanQual) ----------------------------------------------

GATE_KEY = 4242
GATED_APP = "gated-claimer"

_GATE_TRIGGER = f"""
CREATE FUNCTION test_claim_gate() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- Only the gated claimer waits, and only while the test holds advisory lock {GATE_KEY}.
    IF current_setting('application_name') = '{GATED_APP}' THEN
        PERFORM pg_advisory_lock({GATE_KEY});
        PERFORM pg_advisory_unlock({GATE_KEY});
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER test_claim_gate BEFORE UPDATE ON tasks
    FOR EACH ROW EXECUTE FUNCTION test_claim_gate();
"""

# Our claim without the row locks on the candidates: it updates what its snapshot saw, and
# the UPDATE's own recheck (`t.id = l.id`) still holds for a row changed since. What the test
# must catch.
_ROW_LOCKS = "FOR UPDATE OF t SKIP LOCKED"
_CLAIM = queue._CLAIM
_NAIVE_CLAIM = _CLAIM.replace(_ROW_LOCKS, "")


def _interfere(kind: str, session: Session, task: uuid.UUID, company: uuid.UUID) -> None:
    """Commit a change to `task` that makes it ineligible, as another actor would."""
    session.execute(text("SET LOCAL lock_timeout = '3s'"))  # a lock means the gate failed
    if kind == "another claimer":
        # Another claimer's statement without the serializing advisory lock (as a claimer
        # that took no lock, or another deployment, would): it takes the task and commits.
        taken = (
            driver_connection(session)
            .execute(
                _CLAIM,  # the real one, also while the gated claimer runs the naive one
                {
                    "worker_id": "other:1",
                    "company_ids": [company],
                    "shares": [1],
                    "turns": [0],
                    "first_turns": [1],
                    "weights": [1],
                    "cursor_position": 0,
                    "cursor_credit": 0,
                },
            )
            .fetchall()
        )
        assert [row[0] for row in taken] == [task]
    else:
        queue.cancel_task(session, company, task)
    session.commit()


@contextmanager
def _gated_claim(url: str, engine: Engine) -> Iterator[list[list[uuid.UUID]]]:
    """Run a claim that pauses on its first row update; yield while it is paused."""
    result: list[list[uuid.UUID]] = []
    gated = make_engine(url, application_name=GATED_APP)
    with engine.connect() as gate:
        gate.execute(text("SELECT pg_advisory_lock(:k)"), {"k": GATE_KEY})
        gate.commit()

        def run() -> None:
            with make_sessionmaker(gated)() as session:
                result.append([t.id for t in claim(session)])

        thread = threading.Thread(target=run)
        thread.start()
        try:
            _wait_until(lambda: _waiting_on_advisory_lock(engine, GATED_APP) == 1)
            yield result
        finally:
            gate.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": GATE_KEY})
            gate.commit()
            thread.join(10)
            gated.dispose()


@pytest.mark.parametrize("interference", ["another claimer", "cancel"])
def test_a_claim_whose_snapshot_predates_another_commit_never_takes_that_row(
    fresh_engine: Engine, fresh_db_url: str, interference: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Locking a candidate re-evaluates its quals on the newest version (EvalPlanQual).

    Construction: a test-only BEFORE UPDATE trigger makes the gated claimer wait on an
    advisory lock the test holds. The claim locks and updates its candidates one at a time
    (its plan is pinned to nested loops, and the locked candidates are read lazily), so it
    pauses while updating W, after its snapshot saw X as pending and before it locks X.
    Meanwhile another actor changes X and commits (another claimer takes it, the API cancels
    it). When the gate opens, locking X finds a version newer than the snapshot; READ
    COMMITTED re-evaluates the locking query's quals (`status = 'pending'`) on it, which
    rejects it. The second phase runs the same interleaving with the row locks removed from
    the claim and shows that it does take X: the construction really exercises the race.
    """
    sessions = make_sessionmaker(fresh_engine)
    with sessions() as setup:
        setup.execute(text(_GATE_TRIGGER))
        setup.commit()
        company = insert_company(setup).id
    assert _ROW_LOCKS in _CLAIM, "the claim's row locks moved; update the test"

    for naive, x_is_taken in ((False, False), (True, True)):
        if naive:
            monkeypatch.setattr(queue, "_CLAIM", _NAIVE_CLAIM)
        with sessions() as setup:
            setup.execute(text("TRUNCATE tasks"))
            setup.commit()
            # W is the older eligible work, so the gated claim updates it first and pauses
            # before reaching X.
            two_hours_ago = text("now() - interval '2 hours'")
            w = insert_task(setup, company, created_at=two_hours_ago, run_after=two_hours_ago).id
            an_hour_ago = text("now() - interval '1 hour'")
            x = insert_task(setup, company, created_at=an_hour_ago, run_after=an_hour_ago).id
        with _gated_claim(fresh_db_url, fresh_engine) as result, sessions() as other:
            _interfere(interference, other, x, company)
        assert result, "the gated claim did not finish"
        claimed_by_gated = result[0]
        assert claimed_by_gated[0] == w
        assert (x in claimed_by_gated) is x_is_taken, (naive, claimed_by_gated)


# -- many claimers at once: threads and processes ----------------------------------------

CONCURRENT_TASKS = 2000
REPETITIONS = 30


def _claim_until_empty(sessions: Callable[[], Session], worker_id: str) -> list[str]:
    claimed: list[str] = []
    with sessions() as session:
        while True:
            batch = claim(session, worker_id=worker_id, batch_size=50)
            if not batch:
                return claimed
            claimed.extend(str(t.id) for t in batch)


def _claimer_process(url: str, pipe: Pipe, worker_id: str) -> None:
    # A forked child never touches the parent's engine: it builds its own (STACK "Forking").
    engine = make_engine(url, application_name="claimer-process")
    sessions = make_sessionmaker(engine)
    try:
        while pipe.recv() == "go":
            pipe.send(_claim_until_empty(sessions, worker_id))
    finally:
        engine.dispose()
        pipe.close()


@pytest.mark.slow
def test_concurrent_threads_and_processes_never_claim_a_task_twice(fresh_db_url: str) -> None:
    """6 processes and 6 threads drain 2,000 tasks, 30 times: each task claimed exactly once."""
    context = multiprocessing.get_context("fork")
    pipes: list[Pipe] = []
    processes = []
    # Fork before this process has threads or connections (STACK "Forking").
    for i in range(6):
        parent_end, child_end = context.Pipe()
        process = context.Process(
            target=_claimer_process, args=(fresh_db_url, child_end, f"proc:{i}"), daemon=True
        )
        process.start()
        child_end.close()
        pipes.append(parent_end)
        processes.append(process)
    engine = make_engine(fresh_db_url, application_name="claimer-thread", pool_size=8)
    sessions = make_sessionmaker(engine)
    by_threads = by_processes = 0
    try:
        with sessions() as setup:
            companies = [insert_company(setup, f"c{i}").id for i in range(25)]
        for _ in range(REPETITIONS):
            with sessions() as setup:
                # One run_after for all (the statement's now()): ties in the claim's order
                # must not break exclusivity either.
                setup.execute(
                    text(
                        "INSERT INTO tasks (company_id, type, payload, created_at) "
                        "SELECT (CAST(:companies AS uuid[]))[1 + g % 25], 'noop', '{}', "
                        "now() - make_interval(secs => g % 40) "
                        "FROM generate_series(1, :n) AS g"
                    ),
                    {"companies": companies, "n": CONCURRENT_TASKS},
                )
                setup.commit()
            thread_results: list[list[str]] = []
            start = threading.Event()

            def run(
                worker_id: str,
                start: threading.Event = start,
                results: list[list[str]] = thread_results,
            ) -> None:
                start.wait()
                results.append(_claim_until_empty(sessions, worker_id))

            threads = [threading.Thread(target=run, args=(f"thread:{i}",)) for i in range(6)]
            for thread in threads:
                thread.start()
            for pipe in pipes:
                pipe.send("go")
            start.set()
            for thread in threads:
                thread.join(60)
            process_results = [pipe.recv() for pipe in pipes]

            everything = [i for r in thread_results + process_results for i in r]
            assert len(everything) == len(set(everything)), "a task was claimed twice"
            assert len(everything) == CONCURRENT_TASKS, "a task was left unclaimed"
            by_threads += sum(map(len, thread_results))
            by_processes += sum(map(len, process_results))
            with sessions() as check:
                counts = check.execute(
                    text("SELECT status, max(attempts), count(*) FROM tasks GROUP BY status")
                ).all()
                assert [tuple(c) for c in counts] == [("processing", 1, CONCURRENT_TASKS)]
                check.execute(text("TRUNCATE tasks"))
                check.commit()
    finally:
        for pipe in pipes:
            pipe.send("stop")
        for process in processes:
            process.join(10)
        engine.dispose()
    assert all(p.exitcode == 0 for p in processes)
    assert by_threads > 0
    assert by_processes > 0
