"""The claim (design §4): eligibility, fairness, SKIP LOCKED, EvalPlanQual, concurrency.

Weighted shares, in-flight limits, the wake-up protocol and the migration of the weighted fair
claim have their own module, `tests/test_fair_claim.py`.
"""

from __future__ import annotations

import collections
import json
import multiprocessing
import re
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

from db import claims, queue
from db.engine import driver_connection, make_engine, make_sessionmaker
from tests import claim_plans
from tests.factories import (
    MakeCompany,
    MakeTask,
    insert_company,
    insert_delayed_tasks,
    insert_task,
    insert_tasks,
    take_back,
)

STALE = 300.0


def claim(session: Session, **overrides: Any) -> list[claims.ClaimedTask]:
    """Claim with test defaults (worker "test:1", batch 100), then commit."""
    params: dict[str, Any] = {"worker_id": "test:1", "batch_size": 100, **overrides}
    batch = claims.claim(driver_connection(session, transaction=False), **params)
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
    assert claimed.id == task.id
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

    [expired] = take_back(db_session, stale_after=STALE)
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

    [expired] = take_back(db_session, stale_after=STALE)
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

    first = take_back(db_session, stale_after=STALE, limit=2)

    assert {e.id for e in first} == set(leases[:2])
    assert [e.id for e in take_back(db_session, stale_after=STALE)] == leases[2:]


def test_claim_turns_jit_off_for_its_own_statements_only(
    db_session: Session, make_company: MakeCompany, make_task: MakeTask
) -> None:
    """JIT compiles for longer than a claim runs: no statement of the claim is compiled.

    The caller's transaction has JIT on for every statement (`jit_above_cost` 0). The
    statements `fairq_claim` runs (the triggers it fires included) run under its SET
    clauses: auto_explain finds jit off in their settings and none compiled. The call
    itself is planned in the caller's transaction: compiled, where the server can JIT, which
    shows the caller's setting was on throughout; and it is on after the claim.
    """
    make_task(make_company().id)
    db_session.execute(text("SET LOCAL jit = on"))
    db_session.execute(text("SET LOCAL jit_above_cost = 0"))

    batch, statements = claim_plans.claim_statements(db_session, 1)

    assert len(batch) == 1
    *inside, call = statements
    assert call.text.startswith("SELECT * FROM fairq_claim("), call.text
    assert claim_plans.pick(inside, claim_plans.CLAIM)
    for statement in inside:
        assert statement.explained["Settings"].get("jit") == "off", statement.text
        assert "JIT" not in statement.explained, statement.text
    can_jit = db_session.execute(text("SELECT pg_jit_available()")).scalar_one()
    assert ("JIT" in call.explained) is can_jit, call.explained
    assert db_session.execute(text("SHOW jit")).scalar_one() == "on"


def test_claim_leaves_the_callers_planner_settings_as_they_were(
    db_session: Session, make_company: MakeCompany, make_task: MakeTask
) -> None:
    """The claim's settings are SET clauses of `fairq_claim`: they end with the call.

    Before migration 0011 the claim set them for the rest of its caller's transaction. Here
    the caller has each at another value than the claim's, and has it still after the claim.
    """
    make_task(make_company().id)
    settings = claim_plans.claim_settings(db_session)
    assert {"jit", "enable_seqscan", "enable_hashjoin", "plan_cache_mode"} <= set(settings)
    others = {"on": "off", "off": "on", "force_generic_plan": "force_custom_plan"}
    callers = {name: others[value] for name, value in settings.items()}
    for name, value in callers.items():
        db_session.execute(
            text("SELECT set_config(:name, :value, true)"), {"name": name, "value": value}
        )

    assert (
        len(
            claims.claim(
                driver_connection(db_session, transaction=False), worker_id="t", batch_size=1
            )
        )
        == 1
    )

    after = {
        name: db_session.execute(text("SELECT current_setting(:name)"), {"name": name}).scalar_one()
        for name in callers
    }
    assert after == callers


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
        reference = claims.claim(
            driver_connection(claimer, transaction=False), worker_id="test:1", batch_size=100
        )
        claimer.rollback()
        commits: list[int] = []

        def commit() -> None:
            claimer.commit()
            commits.append(len(commits))

        batch = claims.claim(
            driver_connection(claimer, transaction=False),
            worker_id="test:1",
            batch_size=100,
            commit=commit,
        )

        assert commits == [0]
        assert other.execute(
            text("SELECT pg_try_advisory_xact_lock(:key)"), {"key": claims.CLAIM_LOCK_KEY}
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
    assert [e.id for e in take_back(db_session, stale_after=STALE)] == [stale]

    # Turn 1: A's a1 (eligible 60 minutes), B's requeued task (20).
    assert [t.id for t in claim(db_session, batch_size=2)] == [a1, stale]
    # Then, one task a turn: a2 (30), b1 (10), the retried task (1), b2 (5).
    assert [t.id for t in claim(db_session)] == [a2, b1, retried, b2]


# -- the plan: index ranges, never the whole backlog ---------------------------------------


def _scans_of(plan: dict[str, Any], index: str) -> list[tuple[dict[str, Any], tuple[str, ...]]]:
    """The nodes of a plan (its top node) that scan `index`, with their ancestors' types."""
    return [
        (node, parents)
        for node, parents in claim_plans.plan_nodes(plan)
        if node.get("Index Name") == index
    ]


def _seq_scanned(statement: claim_plans.Statement) -> set[str]:
    """The relations a statement reads by sequential scan."""
    return {
        node["Relation Name"]
        for node, _ in claim_plans.plan_nodes(statement.plan)
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
CURSOR_SEQUENCES = {"fairq_claim_cursor_position", "fairq_claim_cursor_credit"}


def test_claim_plan_reads_each_company_as_an_index_range_cut_at_its_share(
    db_session: Session, make_company: MakeCompany
) -> None:
    """Each company's tasks are one LIMITed range scan of its pending index, locked lazily.

    The claim's statement reads ix_tasks_pending_company_run_after with `run_after <= now()`
    as an index condition; the scan feeds LockRows and the Limit of the company's share
    directly (no Sort anywhere), so a company costs at most its share of index entries
    however many rows it has. The contenders' statement walks the ring's index in order from
    the cursor, and both count leases (for a company with a limit) from the company's own
    range of the processing index. Like a live queue, each company has more finished history
    than pending work, some delayed work and some leases; statistics are fresh, so the
    planner has every chance to do otherwise. The plans are those of the statements inside
    `fairq_claim`, as auto_explain logs them.
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

    batch, statements = claim_plans.claim_statements(db_session, 100)

    assert len(batch) == 100
    # One round: every company had work for its share.
    [claim_statement] = claim_plans.pick(statements, claim_plans.CLAIM)
    plan = claim_statement.plan
    scans = _scans_of(plan, PENDING_INDEX)
    assert len(scans) == 1, json.dumps(plan, indent=1)
    [(node, parents)] = scans
    assert node["Node Type"] in ("Index Scan", "Index Only Scan"), node
    # From the company's claim floor (decision 0012), up to the clock the claim read after its
    # waits (a PL/pgSQL variable): both bounds of the range are index conditions.
    assert re.fullmatch(
        r"\(\(company_id = s\.company_id\) AND \(run_after <= \$\d+\) AND "
        r"\(ROW\(run_after, id\) >= "
        r"ROW\(COALESCE\(s\.floor_at, [^)]*\), COALESCE\(s\.floor_id, [^)]*\)\)\)\)",
        node["Index Cond"],
    ), node["Index Cond"]
    # The range scan feeds the row locks and the share's LIMIT: it stops after the share.
    assert parents[-2:] == ("Limit", "LockRows"), parents
    # Nothing sorts the candidates (the top node sorts the claimed batch for handing out).
    assert "Sort" not in parents[1:], parents
    # The claim's limited companies: their leases counted again, under their locks.
    assert _scans_of(plan, PROCESSING_INDEX), json.dumps(plan, indent=1)

    [contenders] = claim_plans.pick(statements, claim_plans.CONTENDERS)
    plan = contenders.plan
    ring = _scans_of(plan, RING_INDEX)
    assert len(ring) == 2, json.dumps(plan, indent=1)  # the rest of the lap, the lap's start
    for node, parents in ring:
        assert node["Index Cond"].startswith("(ring_position "), node
        # Read in index order, as far as the LIMIT needs: nothing sorts the ring.
        assert "Limit" in parents, parents
        assert parents.index("Limit") < parents.index("Append"), parents
        assert "Sort" not in parents, parents
    assert _scans_of(plan, PROCESSING_INDEX), json.dumps(plan, indent=1)
    for statement in (claim_statement, contenders):
        for node, parents in _scans_of(statement.plan, PROCESSING_INDEX):
            assert node["Index Cond"].startswith("(company_id = "), node
            assert parents[-1] == "Limit", parents
    # Read whole: the cursor's two sequences (a row each), and nothing else.
    assert set().union(*map(_seq_scanned, statements)) <= CURSOR_SEQUENCES


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
    about. Counts and pages, not timings: auto_explain's ANALYZE and BUFFERS report what
    each scan node of the claim's statements read.
    """
    busy, *others = (make_company(f"c{i}").id for i in range(5))
    insert_delayed_tasks(db_session, busy, BACKLOG)
    _insert_leases(db_session, busy, LIVE_LEASES, age_seconds=10)
    for company in (busy, *others):
        insert_tasks(db_session, company, 30, newest_age_seconds=60)
    db_session.execute(text("ANALYZE tasks, companies, company_queues"))

    batch, statements = claim_plans.claim_statements(db_session, 100, analyze=True)

    shares = collections.Counter(task.company_id for task in batch)
    assert shares == dict.fromkeys((busy, *others), 20)
    [claim_statement] = claim_plans.pick(statements, claim_plans.CLAIM)
    plan = claim_statement.plan
    [(node, _)] = _scans_of(plan, PENDING_INDEX)
    loops = node["Actual Loops"]
    assert loops == 5, node  # once per company
    assert node.get("Rows Removed by Filter", 0) == 0, node
    assert _rows_read(node) <= 20 * loops, node
    # A btree descent plus the heap pages of at most 20 rows (the test's rows are not
    # all-visible, so an index-only scan still visits the heap): far below the ~100 index
    # and ~300 heap pages the backlog and the leases occupy.
    assert _buffers(node) <= (4 + 20) * loops, node
    assert plan["Actual Rows"] == 100  # every company got its share, the busy one too
    counted = [
        node
        for statement in claim_plans.pick(statements, claim_plans.CONTENDERS)
        for node, _ in claim_plans.plan_nodes(statement.plan)
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


def _thirty_companies_in_the_ring(sessions: Callable[[], Session]) -> list[uuid.UUID]:
    """30 companies with 10 tasks each, all in the ring after a claim of one task each."""
    with sessions() as setup:
        companies = [insert_company(setup, f"c{i}").id for i in range(30)]
        for company in companies:
            insert_tasks(setup, company, 10)
        assert len(claim(setup, worker_id="setup:1", batch_size=30)) == 30  # none short
    return companies


def _the_next_200_turns(batches: list[list[claims.ClaimedTask]]) -> None:
    """Two full, disjoint batches that are together the ring's next 200 turns.

    Weight 1 each, the cursor after the setup's lap: the 30 companies' next six laps and
    the first 20 companies of the seventh, whichever claimer took which stretch.
    """
    assert [len(batch) for batch in batches] == [100, 100]
    first, second = ({task.id for task in batch} for batch in batches)
    assert not first & second
    turns = collections.Counter(task.company_id for batch in batches for task in batch)
    assert sorted(turns.values()) == [6] * 10 + [7] * 20, turns


def test_a_claim_runs_to_the_end_while_another_claim_is_in_flight(fresh_engine: Engine) -> None:
    """Claimers are not serialized (decision 0007): none waits for another's commit.

    The first claim's transaction stays open, holding its rows and the claims' barrier
    (shared). The second, with a lock timeout that turns a wait into an error, gets a full
    batch of other tasks: the ring's next turns, since the first moved the cursor when it
    took its stretch, not when it commits.
    """
    sessions = make_sessionmaker(fresh_engine)
    _thirty_companies_in_the_ring(sessions)
    with sessions() as first, sessions() as second:
        in_flight = claims.claim(
            driver_connection(first, transaction=False), worker_id="first:1", batch_size=100
        )
        second.execute(text("SET LOCAL lock_timeout = '2s'"))
        batches = [in_flight, claim(second, worker_id="second:1")]
        first.commit()
    _the_next_200_turns(batches)


@pytest.mark.slow
def test_concurrent_claimers_released_at_once_get_full_disjoint_batches(
    fresh_engine: Engine, fresh_db_url: str
) -> None:
    """Two claimers released at once both get full, disjoint batches (design §4 evidence).

    Both wait behind the claims' barrier, which the test holds as a pause does, and start
    together when it lets go. Each takes its stretch of the ring under the reservation and
    claims it in parallel with the other: were they to read the ring from the same cursor,
    they would contend for the same tasks and SKIP LOCKED would leave one of them mostly
    empty-handed.
    """
    sessions = make_sessionmaker(fresh_engine)
    _thirty_companies_in_the_ring(sessions)
    claimers = make_engine(fresh_db_url, application_name="parallel-claimer")
    results: list[list[claims.ClaimedTask]] = []
    try:
        with sessions() as holder:
            holder.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": claims.CLAIM_LOCK_KEY})

            def run(worker_id: str) -> None:
                with make_sessionmaker(claimers)() as session:
                    results.append(claim(session, worker_id=worker_id, batch_size=100))

            threads = [threading.Thread(target=run, args=(f"t:{i}",)) for i in range(2)]
            for thread in threads:
                thread.start()
            _wait_until(lambda: _waiting_on_advisory_lock(fresh_engine, "parallel-claimer") == 2)
            holder.rollback()
            for thread in threads:
                thread.join(10)
    finally:
        claimers.dispose()
    _the_next_200_turns(results)


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

# Our claim without the row locks on the candidates, as a function of the test's database:
# it updates what its snapshot saw, and the UPDATE's own recheck (`t.id = l.id`) still holds
# for a row changed since. What the test must catch.
_ROW_LOCKS = "FOR UPDATE OF t SKIP LOCKED"
_NAIVE_CLAIM = "test_naive_claim"


def _create_naive_claim(session: Session) -> None:
    """Create `test_naive_claim`: `fairq_claim` as the database has it, less its row locks.

    Only the candidates' `FOR UPDATE OF t SKIP LOCKED`; the other locks stay.
    """
    definition: str = session.execute(
        text("SELECT pg_get_functiondef('fairq_claim'::regproc)")
    ).scalar_one()
    assert definition.count(_ROW_LOCKS) == 1, "the claim's row locks moved; update the test"
    head = "FUNCTION public.fairq_claim("
    assert definition.count(head) == 1, definition[:200]
    naive = definition.replace(head, f"FUNCTION public.{_NAIVE_CLAIM}(").replace(_ROW_LOCKS, "")
    driver_connection(session).execute(naive)  # no parameters: the text goes as it is
    session.commit()


def _interfere(kind: str, session: Session, task: uuid.UUID, company: uuid.UUID) -> None:
    """Commit a change to `task` that makes it ineligible, as another actor would."""
    session.execute(text("SET LOCAL lock_timeout = '3s'"))  # a lock means the gate failed
    if kind == "another claimer":
        # Another claim, the real one, also while the gated claimer runs the naive one: its
        # stretch of the ring is the company again, whose W the gated claim holds.
        taken = claims.claim(
            driver_connection(session, transaction=False), worker_id="other:1", batch_size=1
        )
        assert [t.id for t in taken] == [task]
    else:
        queue.cancel_task(driver_connection(session, transaction=False), company, task)
    session.commit()


@contextmanager
def _gated_claim(url: str, engine: Engine, *, naive: bool) -> Iterator[list[list[uuid.UUID]]]:
    """Run a claim (or the naive one) that pauses on its first row update; yield meanwhile."""
    result: list[list[uuid.UUID]] = []
    gated = make_engine(url, application_name=GATED_APP)
    with engine.connect() as gate:
        gate.execute(text("SELECT pg_advisory_lock(:k)"), {"k": GATE_KEY})
        gate.commit()

        def run() -> None:
            with make_sessionmaker(gated)() as session:
                if naive:
                    rows = driver_connection(session).execute(
                        f"SELECT id FROM {_NAIVE_CLAIM}(%(worker_id)s, %(batch_size)s)",
                        {"worker_id": "test:1", "batch_size": 100},
                    )
                    ids = [row[0] for row in rows]
                    session.commit()
                else:
                    ids = [t.id for t in claim(session)]
                result.append(ids)

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
    fresh_engine: Engine, fresh_db_url: str, interference: str
) -> None:
    """Locking a candidate re-evaluates its quals on the newest version (EvalPlanQual).

    Construction: a test-only BEFORE UPDATE trigger makes the gated claimer wait on an
    advisory lock the test holds. The claim locks and updates its candidates one at a time
    (its plan is pinned to nested loops, and the locked candidates are read lazily), so it
    pauses while updating W, after its snapshot saw X as pending and before it locks X.
    Meanwhile another actor changes X and commits (another claimer takes it, the API cancels
    it). When the gate opens, locking X finds a version newer than the snapshot; READ
    COMMITTED re-evaluates the locking query's quals (`status = 'pending'`) on it, which
    rejects it. The second phase runs the same interleaving with a copy of the claim without
    the row locks (`test_naive_claim`) and shows that it does take X: the construction really
    exercises the race.
    """
    sessions = make_sessionmaker(fresh_engine)
    with sessions() as setup:
        setup.execute(text(_GATE_TRIGGER))
        setup.commit()
        _create_naive_claim(setup)
        company = insert_company(setup).id

    for naive, x_is_taken in ((False, False), (True, True)):
        with sessions() as setup:
            setup.execute(text("TRUNCATE tasks"))
            setup.commit()
            # The company in the ring, as it is when its work keeps coming: another claimer
            # reads it there, while the gated claim has not committed.
            insert_task(setup, company)
            assert len(claim(setup, worker_id="setup:1", batch_size=1)) == 1
            # W is the older eligible work, so the gated claim updates it first and pauses
            # before reaching X.
            two_hours_ago = text("now() - interval '2 hours'")
            w = insert_task(setup, company, created_at=two_hours_ago, run_after=two_hours_ago).id
            an_hour_ago = text("now() - interval '1 hour'")
            x = insert_task(setup, company, created_at=an_hour_ago, run_after=an_hour_ago).id
        with _gated_claim(fresh_db_url, fresh_engine, naive=naive) as result, sessions() as other:
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
