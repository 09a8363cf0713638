"""The claim (DESIGN §4): eligibility, fairness, SKIP LOCKED, EvalPlanQual, concurrency."""

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
from db.engine import make_engine, make_sessionmaker
from scripts import bench_claim
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
    """Claim with test defaults (batch 100, cap 10, stale 300 s), then commit."""
    params: dict[str, Any] = {
        "worker_id": "test:1",
        "batch_size": 100,
        "per_company_cap": 10,
        "stale_after": STALE,
        **overrides,
    }
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
    assert claimed.payload == {"k": 1}
    assert claimed.attempts == stored["attempts"] == 1
    assert claimed.max_attempts == 5
    assert claimed.lease_token == stored["lease_token"] is not None
    assert stored["status"] == "processing"
    assert stored["locked_by"] == "host:42"
    assert stored["locked_at"] is not None
    assert stored["started_at"] == stored["locked_at"]
    assert stored["updated_at"] == stored["locked_at"]


def test_claim_ignores_future_terminal_and_freshly_locked_tasks(
    db_session: Session, make_company: MakeCompany, make_task: MakeTask
) -> None:
    company = make_company()
    make_task(company.id, run_after=text("now() + interval '1 minute'"))
    for status in ("completed", "failed", "cancelled"):
        make_task(company.id, status=status)
    make_task(
        company.id,
        status="processing",
        attempts=1,
        lease_token=uuid.uuid4(),
        locked_at=text("now() - interval '299 seconds'"),
    )
    runnable = make_task(company.id, run_after=text("now() - interval '1 second'"))

    assert [t.id for t in claim(db_session)] == [runnable.id]
    assert claim(db_session) == []


def test_claim_recovers_a_stale_lease_keeping_started_at(
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

    [claimed] = claim(db_session, worker_id="alive:2")

    stored = fetch(db_session, stale.id)
    assert claimed.id == stale.id
    assert claimed.attempts == stored["attempts"] == 3
    assert claimed.lease_token != old_token
    assert stored["locked_by"] == "alive:2"
    assert stored["started_at"] < stored["locked_at"]


def test_claim_leaves_stale_tasks_without_attempts_left_to_the_sweep(
    db_session: Session, make_company: MakeCompany, make_task: MakeTask
) -> None:
    company = make_company()
    make_task(
        company.id,
        status="processing",
        attempts=3,
        max_attempts=3,
        lease_token=uuid.uuid4(),
        locked_at=text("now() - interval '1 hour'"),
    )
    assert claim(db_session) == []


def test_claim_turns_jit_off_for_its_transaction(
    db_session: Session, make_company: MakeCompany, make_task: MakeTask
) -> None:
    make_task(make_company().id)
    queue.claim(db_session, worker_id="t", batch_size=1, per_company_cap=1, stale_after=STALE)
    assert db_session.execute(text("SHOW jit")).scalar_one() == "off"


# -- fairness ----------------------------------------------------------------------------


def test_quiet_companies_get_into_the_first_batch_despite_a_flood(
    db_session: Session, make_company: MakeCompany
) -> None:
    """A flooder's 10,000 older tasks cannot push two quiet companies out of a batch.

    The quiet tasks are newer than every flooder task, so only the per-company rank puts
    them in; the order is exactly rank first, then eligible since (DESIGN §1.3; for tasks
    runnable since creation, as these, that is created_at).
    """
    flooder, quiet_a, quiet_b = (make_company(n) for n in ("flooder", "quiet-a", "quiet-b"))
    flood = insert_tasks(db_session, flooder.id, 10_000, newest_age_seconds=7200)
    a1, a2 = insert_tasks(db_session, quiet_a.id, 2, newest_age_seconds=3000)  # -3001, -3000
    b1, b2 = insert_tasks(db_session, quiet_b.id, 2, newest_age_seconds=2999.5)

    batch = claim(db_session, batch_size=100, per_company_cap=10)

    # rank 1: the flooder's oldest, then A, then B; rank 2 likewise; ranks 3-10 flooder only.
    expected = [flood[0], a1, b1, flood[1], a2, b2, *flood[2:10]]
    assert [t.id for t in batch] == expected


def test_a_short_batch_takes_every_company_oldest_before_anyone_second(
    db_session: Session, make_company: MakeCompany
) -> None:
    flooder, quiet_a, quiet_b = (make_company(n) for n in ("flooder", "quiet-a", "quiet-b"))
    flood = insert_tasks(db_session, flooder.id, 50, newest_age_seconds=7200)
    a1, _ = insert_tasks(db_session, quiet_a.id, 2, newest_age_seconds=60)
    b1, _ = insert_tasks(db_session, quiet_b.id, 2, newest_age_seconds=30)

    assert [t.id for t in claim(db_session, batch_size=4)] == [flood[0], a1, b1, flood[1]]


def test_per_company_cap_limits_a_batch(db_session: Session, make_company: MakeCompany) -> None:
    only = make_company()
    insert_tasks(db_session, only.id, 30)
    assert len(claim(db_session, batch_size=100, per_company_cap=7)) == 7


def _plan_nodes(
    node: dict[str, Any], parents: tuple[str, ...] = ()
) -> Iterator[tuple[dict[str, Any], tuple[str, ...]]]:
    yield node, parents
    for child in node.get("Plans", []):
        yield from _plan_nodes(child, (*parents, node["Node Type"]))


CLAIM_INDEXES = {
    # index name -> the range its Index Cond must contain (the eligibility bound).
    "ix_tasks_pending_company_run_after": "(run_after <= now())",
    "ix_tasks_processing_company_locked_at": "(locked_at < (now() - ",
}


def _candidate_scans(plan: dict[str, Any]) -> list[tuple[dict[str, Any], tuple[str, ...]]]:
    """The plan nodes that scan the claim's two candidate indexes, with their ancestors."""
    return [
        (node, parents)
        for node, parents in _plan_nodes(plan["Plan"])
        if node.get("Index Name") in CLAIM_INDEXES
    ]


def test_claim_plan_scans_the_claim_indexes_as_ranges_per_company(
    db_session: Session, make_company: MakeCompany
) -> None:
    """Each company's candidates are two LIMITed index range scans, merged without a Sort.

    Pending work comes from ix_tasks_pending_company_run_after with `run_after <= now()` as
    an index condition, stale leases from ix_tasks_processing_company_locked_at with
    `locked_at < now() - stale_after`; each scan feeds its Limit directly and a Merge Append
    combines them in order (no Sort anywhere), so a company costs at most
    2 * `per_company_cap` index entries however many rows it has. Like a live queue, each
    company has more finished history than pending work, some delayed work and some
    leases, live and stale.
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
        _insert_leases(db_session, company, 5, age_seconds=3600)
    db_session.execute(text("ANALYZE tasks, companies"))
    [plan] = db_session.execute(
        text("EXPLAIN (FORMAT JSON) " + str(queue._CLAIM.text)),
        {"worker_id": "t", "batch_size": 100, "per_company_cap": 10, "stale_after": STALE},
    ).scalar_one()

    scans = _candidate_scans(plan)
    assert sorted(node["Index Name"] for node, _ in scans) == sorted(CLAIM_INDEXES), json.dumps(
        plan, indent=1
    )
    for node, parents in scans:
        assert node["Node Type"] in ("Index Scan", "Index Only Scan"), node
        assert node["Index Cond"].startswith("((company_id = c.id) AND "), node["Index Cond"]
        assert CLAIM_INDEXES[node["Index Name"]] in node["Index Cond"], node["Index Cond"]
        # The range scan feeds its LIMIT directly: it stops after per_company_cap rows.
        assert parents[-1] == "Limit", parents
        # Both streams are merged in order per company, then ranked and cut at the cap.
        merge = len(parents) - 1 - parents[::-1].index("Merge Append")
        assert parents[merge - 2 : merge] == ("Limit", "WindowAgg"), parents
        # No Sort anywhere between the scans and the per-company LIMIT: the merge reads
        # each stream in index order, lazily.
        assert parents[merge + 1 :] == ("Limit",), parents


# -- a tenant's delayed backlog and live leases cost the claim nothing ------------------


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


def _explain_analyze(session: Session, sql: str) -> dict[str, Any]:
    """EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) of a claim statement, its effects undone."""
    savepoint = session.begin_nested()
    try:
        session.execute(text("SELECT set_config('jit', 'off', true)"))
        [plan] = session.execute(
            text("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql),
            {"worker_id": "t", "batch_size": 100, "per_company_cap": 10, "stale_after": STALE},
        ).scalar_one()
    finally:
        savepoint.rollback()
    result: dict[str, Any] = plan
    return result


def _rows_read(node: dict[str, Any]) -> float:
    """Rows a scan node produced or filtered out, over all its loops."""
    per_loop = node["Actual Rows"] + node.get("Rows Removed by Filter", 0)
    return float(per_loop * node["Actual Loops"])


def _buffers(node: dict[str, Any]) -> int:
    """Pages a node touched (cache hits and reads), over all its loops."""
    return int(node["Shared Hit Blocks"] + node["Shared Read Blocks"])


BACKLOG = 20_000
LIVE_LEASES = 2_000


def test_claim_cost_does_not_grow_with_a_tenants_delayed_backlog(
    db_session: Session, make_company: MakeCompany
) -> None:
    """One tenant's 20,000 delayed tasks and 2,000 live leases are never read by a claim.

    The claim's candidate scans read at most `per_company_cap` (10) entries per company and
    branch, and touch a few pages per company: bounds that do not mention the backlog. The
    same workload under the claim before migration 0002 (a created_at-ordered scan that
    filters eligibility row by row) reads the whole backlog, which shows the workload
    exercises what the bound is about. Counts and pages, not timings: EXPLAIN (ANALYZE,
    BUFFERS) reports what each scan node read.
    """
    busy, *others = (make_company(f"c{i}").id for i in range(5))
    insert_delayed_tasks(db_session, busy, BACKLOG)
    _insert_leases(db_session, busy, LIVE_LEASES, age_seconds=10)
    for company in (busy, *others):
        insert_tasks(db_session, company, 30, newest_age_seconds=60)
    db_session.execute(text("ANALYZE tasks, companies"))

    plan = _explain_analyze(db_session, str(queue._CLAIM.text))
    scans = _candidate_scans(plan)
    assert len(scans) == 2, json.dumps(plan, indent=1)
    for node, _ in scans:
        loops = node["Actual Loops"]
        assert loops == 5, node  # once per company
        assert node.get("Rows Removed by Filter", 0) == 0, node
        assert _rows_read(node) <= 10 * loops, node
        # A btree descent plus the heap pages of at most 10 rows (the test's rows are not
        # all-visible, so an index-only scan still visits the heap): far below the ~100
        # index and ~300 heap pages the backlog and the leases occupy.
        assert _buffers(node) <= (4 + 10) * loops, node
    claimed = plan["Plan"]["Actual Rows"]
    assert claimed == 5 * 10  # every company got its cap, the busy one included

    # The control: the claim before 0002, on its own index, reads past the whole backlog.
    db_session.execute(text(bench_claim.BEFORE_0002_INDEX_DDL))
    before = _explain_analyze(db_session, bench_claim.BEFORE_0002_SQL)
    read_before = sum(
        _rows_read(node)
        for node, _ in _plan_nodes(before["Plan"])
        if node.get("Relation Name") == "tasks" and "Index Cond" in node
        and "c.id" in node["Index Cond"]
    )  # fmt: skip
    assert read_before >= BACKLOG + LIVE_LEASES, json.dumps(before, indent=1)


def test_a_retried_task_queues_behind_work_that_became_eligible_before_it(
    db_session: Session, make_company: MakeCompany, make_task: MakeTask
) -> None:
    """Within a company, eligible since orders the candidates; across companies, rank does.

    A's oldest task failed and was retried with backoff that ran out a minute ago: it has
    been eligible for a minute only, so A's two younger tasks (eligible since creation, 60
    and 30 minutes ago) go first. B's stale lease has waited since its holder was last heard
    of 20 minutes ago (its lease ran out 15 minutes ago), before B's pending tasks became
    eligible. Across companies the rank comes first (DESIGN §1.3): every company's first
    before anyone's second.
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

    # Rank 1: A's a1 (eligible 60 minutes), B's stale lease (20); then rank 2: a2 (30), b1
    # (10); rank 3: b2 (5), the retried task (1). A short batch takes a prefix of that order.
    assert [t.id for t in claim(db_session, batch_size=2)] == [a1, stale]
    # Rank 1 now: a2, b1; rank 2: b2, then the retried task.
    assert [t.id for t in claim(db_session)] == [a2, b1, b2, retried]


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
    """Two claimers released at once both get full, disjoint batches (DESIGN §4 evidence).

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
                    results.append(claim(session, batch_size=100, per_company_cap=10))

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

# Our claim without the predicate on the locked row: what the test must catch.
_LOCKED_PREDICATE = """    WHERE (t.status = 'pending' AND t.run_after <= now())
       OR (t.status = 'processing'
           AND t.locked_at < now() - make_interval(secs => CAST(:stale_after AS float8))
           AND t.attempts < t.max_attempts)
    -- OF t"""
_NAIVE_CLAIM = str(queue._CLAIM.text).replace(_LOCKED_PREDICATE, "    -- OF t")


def _interfere(kind: str, session: Session, task: uuid.UUID, company: uuid.UUID) -> None:
    """Commit a change to `task` that makes it ineligible, as another actor would."""
    session.execute(text("SET LOCAL lock_timeout = '3s'"))  # a lock means the gate failed
    if kind == "another claimer":
        # Another claimer's statement without the serializing advisory lock (as a claimer
        # that took no lock, or another deployment, would): it takes the task and commits.
        params = {"worker_id": "other:1", "batch_size": 100, "per_company_cap": 10}
        taken = session.execute(queue._CLAIM, {**params, "stale_after": STALE}).all()
        assert [r.id for r in taken] == [task]
    elif kind == "heartbeat":
        lease = queue.Lease(task, session.execute(
            text("SELECT lease_token FROM tasks WHERE id = :id"), {"id": task}
        ).scalar_one())  # fmt: skip
        assert queue.heartbeat(session, [lease]) == {task}
    else:
        queue.cancel_task(session, company, task)
    session.commit()


@contextmanager
def _gated_claim(url: str, engine: Engine, sql: str | None) -> Iterator[list[list[Any]]]:
    """Run a claim that pauses on its first row update; yield while it is paused."""
    result: list[list[Any]] = []
    # Hash and merge joins would lock every candidate before updating the first; nested
    # loops lock and update one row at a time, which is what lets the gate pause in between.
    gated = make_engine(
        url,
        application_name=GATED_APP,
        connect_args={"options": "-c enable_hashjoin=off -c enable_mergejoin=off"},
    )
    with engine.connect() as gate:
        gate.execute(text("SELECT pg_advisory_lock(:k)"), {"k": GATE_KEY})
        gate.commit()

        def run() -> None:
            with make_sessionmaker(gated)() as session:
                if sql is None:
                    result.append([t.id for t in claim(session)])
                else:
                    params = {"worker_id": GATED_APP, "batch_size": 100, "per_company_cap": 10}
                    rows = session.execute(text(sql), {**params, "stale_after": STALE}).all()
                    session.commit()
                    result.append([r.id for r in rows])

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


@pytest.mark.parametrize("interference", ["another claimer", "heartbeat", "cancel"])
def test_a_claim_whose_snapshot_predates_another_commit_never_takes_that_row(
    fresh_engine: Engine, fresh_db_url: str, interference: str
) -> None:
    """The full eligibility predicate on the locked row drops rows changed after the snapshot.

    Construction: a test-only BEFORE UPDATE trigger makes the gated claimer wait on an
    advisory lock the test holds. The claim locks and updates its candidates one at a time
    in (rank, created_at) order, so it pauses while updating W, after its snapshot saw X as
    eligible and before it locks X. Meanwhile another actor changes X and commits (another
    claimer takes it, its holder heartbeats it, the API cancels it). When the gate opens,
    locking X finds a version newer than the snapshot; READ COMMITTED re-evaluates the
    locking query's quals on it (EvalPlanQual), which must reject it. (The gated session
    disables hash and merge joins so its plan locks and updates one row at a time.) The
    second phase runs
    the same interleaving with the predicate removed from the locked row and shows that it
    does take X: the construction really exercises the race.
    """
    sessions = make_sessionmaker(fresh_engine)
    with sessions() as setup:
        setup.execute(text(_GATE_TRIGGER))
        setup.commit()
        company = insert_company(setup).id
    assert queue._CLAIM.text != _NAIVE_CLAIM, "the locked-row predicate moved; update the test"

    for sql, x_is_taken in ((None, False), (_NAIVE_CLAIM, True)):
        with sessions() as setup:
            setup.execute(text("TRUNCATE tasks"))
            setup.commit()
            # W is the older eligible work (runnable since its creation, as the API leaves a
            # task), so the gated claim updates it first and pauses before reaching X.
            two_hours_ago = text("now() - interval '2 hours'")
            w = insert_task(setup, company, created_at=two_hours_ago, run_after=two_hours_ago).id
            if interference == "heartbeat":
                x = insert_task(
                    setup,
                    company,
                    status="processing",
                    attempts=1,
                    lease_token=uuid.uuid4(),
                    locked_by="holder:1",
                    locked_at=text("now() - interval '1 hour'"),
                ).id
            else:
                an_hour_ago = text("now() - interval '1 hour'")
                x = insert_task(setup, company, created_at=an_hour_ago, run_after=an_hour_ago).id
        with _gated_claim(fresh_db_url, fresh_engine, sql) as result, sessions() as other:
            _interfere(interference, other, x, company)
        assert result, "the gated claim did not finish"
        claimed_by_gated = result[0]
        assert claimed_by_gated[0] == w
        assert (x in claimed_by_gated) is x_is_taken, (sql is not None, claimed_by_gated)


# -- many claimers at once: threads and processes ----------------------------------------

CONCURRENT_TASKS = 2000
REPETITIONS = 30


def _claim_until_empty(sessions: Callable[[], Session], worker_id: str) -> list[str]:
    claimed: list[str] = []
    with sessions() as session:
        while True:
            batch = claim(session, worker_id=worker_id, batch_size=50, per_company_cap=10)
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
                # Many equal created_at values: ties must not break exclusivity either.
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
