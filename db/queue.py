"""Every statement that reads or moves tasks through the state machine (DESIGN §4).

Callers own the session and commit; functions here never commit. Timestamps always come
from the database clock (`now()`), never from Python.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from sqlalchemy import CursorResult, func, select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from db import errors
from db.models import UQ_TASK_IDEMPOTENCY_KEY, Task, TaskStatus

# ---------------------------------------------------------------------------------------------
# API-side statements: create, read, list, cancel, retry
# ---------------------------------------------------------------------------------------------


def create_task(
    session: Session,
    *,
    company_id: uuid.UUID,
    type: str,
    payload: dict[str, Any],
    run_at: dt.datetime | None = None,
    max_attempts: int = 5,
    idempotency_key: str | None = None,
    request_hash: str | None = None,
    notify_channel: str | None = None,
) -> tuple[Task, bool]:
    """Insert a pending task and wake idle workers; return `(task, created)`.

    With an `idempotency_key`, a concurrent or earlier request with the same key resolves
    through the unique constraint (`INSERT ... ON CONFLICT DO NOTHING`, then read): the
    existing task is returned with `created=False`, or `errors.IdempotencyKeyReused` is raised
    when its `request_hash` differs (IETF Idempotency-Key draft, section 2.7).
    `NOTIFY notify_channel` is sent in the caller's transaction, so it fires only on commit.
    """
    values: dict[str, Any] = {
        "company_id": company_id,
        "type": type,
        "payload": payload,
        "status": TaskStatus.PENDING.value,
        "max_attempts": max_attempts,
        # A run_at in the past means "now": it must not jump ahead of work that has been
        # runnable longer (the claim orders by eligible-since).
        "run_after": func.greatest(run_at, func.now()) if run_at is not None else func.now(),
        "idempotency_key": idempotency_key,
        "request_hash": request_hash,
    }
    stmt = pg_insert(Task).values(**values)
    if idempotency_key is not None:
        stmt = stmt.on_conflict_do_nothing(constraint=UQ_TASK_IDEMPOTENCY_KEY)
    # The conflicting row can vanish between the INSERT and the read (retention deleted it,
    # or its inserter rolled back): then the key is free again, so insert once more.
    for _ in range(_CREATE_ATTEMPTS):
        task = session.scalars(stmt.returning(Task)).one_or_none()
        if task is not None:
            if notify_channel:
                session.execute(select(func.pg_notify(notify_channel, str(task.company_id))))
            return task, True
        existing = _existing_for_key(session, company_id, idempotency_key)
        if existing is not None:
            if existing.request_hash != request_hash:
                raise errors.IdempotencyKeyReused(
                    "this Idempotency-Key was already used with a different request body"
                )
            return existing, False
    raise errors.Conflict("the Idempotency-Key is in flux (created and deleted); retry")


# INSERT/read rounds before giving up on a key whose row keeps disappearing.
_CREATE_ATTEMPTS = 3


def _existing_for_key(session: Session, company_id: uuid.UUID, key: str | None) -> Task | None:
    # READ COMMITTED: ON CONFLICT waited for the other inserter to commit, so this new
    # statement sees its row, unless it was deleted in between.
    return session.scalars(
        select(Task).where(Task.company_id == company_id, Task.idempotency_key == key)
    ).one_or_none()


def get_task(session: Session, company_id: uuid.UUID, task_id: uuid.UUID) -> Task:
    """The company's task. Raises `errors.NotFound` if absent or owned by another company."""
    task = session.scalars(
        select(Task).where(Task.id == task_id, Task.company_id == company_id)
    ).one_or_none()
    if task is None:
        raise errors.NotFound("task not found")
    return task


def list_tasks(
    session: Session,
    company_id: uuid.UUID,
    *,
    status: str | None = None,
    type: str | None = None,
    limit: int = 20,
    offset: int = 0,
) -> tuple[Sequence[Task], bool]:
    """One page of the company's tasks, newest first; return `(items, has_more)`.

    Ordered by `(created_at DESC, id DESC)` (served by `ix_tasks_company_listing`).
    """
    stmt = select(Task).where(Task.company_id == company_id)
    if status is not None:
        stmt = stmt.where(Task.status == status)
    if type is not None:
        stmt = stmt.where(Task.type == type)
    stmt = stmt.order_by(Task.created_at.desc(), Task.id.desc()).limit(limit + 1).offset(offset)
    rows = session.scalars(stmt).all()
    return rows[:limit], len(rows) > limit


def _transition(
    session: Session,
    company_id: uuid.UUID,
    task_id: uuid.UUID,
    *,
    from_statuses: Sequence[TaskStatus],
    values: dict[str, Any],
    action: str,
) -> Task:
    # One conditional UPDATE: no read-then-write race with a claimer.
    stmt = (
        update(Task)
        .where(
            Task.id == task_id,
            Task.company_id == company_id,
            Task.status.in_([s.value for s in from_statuses]),
        )
        .values(updated_at=func.now(), **values)
        .returning(Task)
        .execution_options(synchronize_session=False)
    )
    task = session.scalars(stmt).one_or_none()
    if task is not None:
        return task
    current = get_task(session, company_id, task_id)  # raises NotFound
    allowed = " or ".join(s.value for s in from_statuses)
    raise errors.Conflict(f"cannot {action} a task in status {current.status!r} (only {allowed})")


def cancel_task(session: Session, company_id: uuid.UUID, task_id: uuid.UUID) -> Task:
    """Move a pending task to `cancelled`.

    Raises `errors.NotFound`, or `errors.Conflict` when it is not pending.
    """
    return _transition(
        session,
        company_id,
        task_id,
        from_statuses=(TaskStatus.PENDING,),
        values={"status": TaskStatus.CANCELLED.value, "finished_at": func.now()},
        action="cancel",
    )


def retry_task(session: Session, company_id: uuid.UUID, task_id: uuid.UUID) -> Task:
    """Move a failed or cancelled task back to `pending`, runnable now, with attempts reset.

    Raises `errors.NotFound`, or `errors.Conflict` from any other status.
    """
    return _transition(
        session,
        company_id,
        task_id,
        from_statuses=(TaskStatus.FAILED, TaskStatus.CANCELLED),
        values={
            "status": TaskStatus.PENDING.value,
            "attempts": 0,
            "run_after": func.now(),
            "finished_at": None,
            "lease_token": None,
            "locked_by": None,
            "locked_at": None,
        },
        action="retry",
    )


# ---------------------------------------------------------------------------------------------
# Worker-side statements: claim, poison-pill sweep, heartbeat, fenced finalization
# ---------------------------------------------------------------------------------------------

# Key of the transaction-scoped advisory lock that serializes claimers ("fairqcl" in ASCII).
CLAIM_LOCK_KEY = 0x66_61_69_72_71_63_6C

# `last_error` is for humans; a handler's error can be arbitrarily long.
MAX_ERROR_CHARS = 2000


class Lease(NamedTuple):
    """A task a worker holds: its id and the fencing token it was claimed with."""

    task_id: uuid.UUID
    token: uuid.UUID


@dataclass(frozen=True)
class ClaimedTask:
    """A row the claim moved to `processing`, as the processing pass needs it.

    `attempts` already counts this attempt (1 on the first run).
    """

    id: uuid.UUID
    company_id: uuid.UUID
    type: str
    payload: dict[str, Any]
    attempts: int
    max_attempts: int
    lease_token: uuid.UUID
    created_at: dt.datetime

    @property
    def lease(self) -> Lease:
        """The `(id, token)` pair every fenced statement needs."""
        return Lease(self.id, self.lease_token)


_SERIALIZE_CLAIMERS = text(
    # pg_advisory_xact_lock: claimers queue here, one at a time, until the holder commits. Two
    # concurrent claimers compute the same candidates, so without it most of their batches
    # come back short (SKIP LOCKED skips what the other took; DESIGN §4 claim evidence).
    # Taken in its own statement so the claim's snapshot is taken after the previous claimer
    # committed. set_config(..., true) is SET LOCAL: with many tenants the claim's cost
    # estimate crosses jit_above_cost, and compiling costs more than the claim itself.
    "SELECT pg_advisory_xact_lock(:key), set_config('jit', 'off', true)"
)

_CLAIM = text(
    """
WITH candidates AS (
    -- Driven by the companies table, not SELECT DISTINCT company_id over tasks: that costs
    -- a scan of every live row; this costs two index probes per company.
    SELECT k.id, k.eligible_at, k.rank
    FROM companies c
    CROSS JOIN LATERAL (
        -- Per-company top-K by "eligible since", merged from two streams that each arrive
        -- in eligible_at order and each stop after per_company_cap rows: a Merge Append of
        -- two LIMITed index range scans, so a company costs at most 2 * per_company_cap
        -- index entries however many delayed rows or live leases it has. No Sort: rank
        -- comes from the merge order.
        SELECT e.id, e.eligible_at,
               row_number() OVER (ORDER BY e.eligible_at, e.id) AS rank
        FROM (
            (
                -- Runnable pending work became eligible at run_after (= created_at unless
                -- scheduled with run_at or backed off). ix_tasks_pending_company_run_after
                -- (company_id, run_after, id) WHERE status = 'pending': the range
                -- run_after <= now() is an index condition, so rows scheduled or backed off
                -- into the future are never read. Index-only (id is a key column) where the
                -- visibility map allows.
                SELECT t.id, t.run_after AS eligible_at
                FROM tasks t
                WHERE t.company_id = c.id
                  AND t.status = 'pending'
                  AND t.run_after <= now()
                ORDER BY t.run_after, t.id
                LIMIT :per_company_cap
            )
            UNION ALL
            (
                -- A lease whose holder stopped heartbeating (crash) has waited for a worker
                -- since its holder was last known alive: locked_at (lease start, refreshed by
                -- every heartbeat). ix_tasks_processing_company_locked_at (company_id,
                -- locked_at, id) WHERE status = 'processing': the range locked_at < now() -
                -- stale_after is an index condition, so live leases are never read.
                -- attempts < max_attempts leaves poison pills to fail_lost_tasks (run before
                -- every claim, so few are ever filtered out here). Ordered by the column
                -- itself, not locked_at + stale_after: then the merge needs no Sort and reads
                -- this stream lazily, usually one row.
                SELECT t.id, t.locked_at AS eligible_at
                FROM tasks t
                WHERE t.company_id = c.id
                  AND t.status = 'processing'
                  AND t.locked_at < now() - make_interval(secs => CAST(:stale_after AS float8))
                  AND t.attempts < t.max_attempts
                ORDER BY t.locked_at, t.id
                LIMIT :per_company_cap
            )
        ) e
        -- id breaks ties, so the order (and the batch) is deterministic.
        ORDER BY e.eligible_at, e.id
        LIMIT :per_company_cap
    ) k
),
picked AS (
    -- Fairness (DESIGN §1.3): every company's longest-waiting task before any company's
    -- second one, and so on; within a rank, longest waiting first.
    SELECT id, eligible_at, rank FROM candidates ORDER BY rank, eligible_at, id
    LIMIT :batch_size
),
locked AS (
    SELECT t.id, p.rank, p.eligible_at
    FROM tasks t
    JOIN picked p ON p.id = t.id
    -- The full eligibility predicate again, on the row being locked: if another transaction
    -- changed the row after our snapshot (a claimer took it, its holder heartbeated, the API
    -- cancelled it), READ COMMITTED re-checks these quals on the newest version
    -- (EvalPlanQual) and drops the row instead of claiming it twice.
    WHERE (t.status = 'pending' AND t.run_after <= now())
       OR (t.status = 'processing'
           AND t.locked_at < now() - make_interval(secs => CAST(:stale_after AS float8))
           AND t.attempts < t.max_attempts)
    -- OF t: lock task rows only. SKIP LOCKED: a row another transaction holds is not worth
    -- waiting for; it is that transaction's to claim or finalize.
    FOR UPDATE OF t SKIP LOCKED
),
claimed AS (
    UPDATE tasks t
    SET status = 'processing',
        attempts = t.attempts + 1,            -- crashes count too (poison pills)
        lease_token = gen_random_uuid(),      -- the fencing token of this attempt
        locked_by = :worker_id,
        -- statement_timestamp(), not now() (the transaction start, before the wait for the
        -- claimers' advisory lock): a lease must not start shortened by that wait.
        locked_at = statement_timestamp(),    -- lease start; refreshed by heartbeat
        started_at = coalesce(t.started_at, statement_timestamp()),
        updated_at = statement_timestamp()
    FROM locked l
    WHERE t.id = l.id
    RETURNING t.id, t.company_id, t.type, t.payload, t.attempts, t.max_attempts,
              t.lease_token, t.created_at, l.rank, l.eligible_at
)
-- UPDATE ... RETURNING has no order; hand the batch out in fairness order.
SELECT id, company_id, type, payload, attempts, max_attempts, lease_token, created_at
FROM claimed
ORDER BY rank, eligible_at, id
"""
)


def claim(
    session: Session,
    *,
    worker_id: str,
    batch_size: int,
    per_company_cap: int,
    stale_after: float,
) -> list[ClaimedTask]:
    """Claim up to `batch_size` eligible tasks fairly; return them in claim order.

    Eligible (DESIGN §4): `pending` with `run_after <= now()`, or `processing` whose lease is
    older than `stale_after` seconds and that has attempts left. Each claimed row gets a new
    `lease_token` and counts an attempt. Run it under READ COMMITTED (the default) and commit
    right after: the advisory lock taken here serializes every claimer until then.

    Order: each company's eligible tasks are ranked by how long they have been waiting for a
    worker ("eligible since"): `run_after` for pending work (when it became runnable),
    `locked_at` for a stale lease (when its holder was last known alive: lease start or last
    heartbeat; the task has waited since about then, not only since the lease ran out
    `stale_after` later); at most `per_company_cap` per company; the batch is ordered by
    (per-company rank, eligible since, id). Deviation from DESIGN §4 ("rank by created_at",
    migration 0002): for a task created without `run_at` and never retried,
    `run_after == created_at` (both `now()` of the creating transaction), so the order is
    created_at order as before. A task retried with backoff, or scheduled with `run_at`,
    queues behind work of its company that became eligible before it (and one scheduled in
    the past goes ahead of younger work: its `run_at` is when it became eligible); a released
    task keeps its `run_after` and so its place. Fairness across companies is unchanged:
    every company's rank 1 before anyone's rank 2.

    Why not created_at: eligibility depends on `now()`, which no index predicate may
    mention, so an index in created_at order holds not-yet-runnable rows too, and a claim
    must read past all of them (one tenant's 300,000 delayed rows made every claim, for
    every tenant, take 150 to 580 ms instead of 5 to 8, all of it under the claim lock;
    `scripts/bench_claim.py --delayed-backlog`). Keeping strict created_at order at
    O(per_company_cap) would take a separate state for delayed work that a promoter moves to
    `pending` when due: a new status and a new moving part, for an order that "oldest
    eligible first" does not need. In run_after order the runnable rows are a prefix of the
    index range, so each company costs at most 2 * `per_company_cap` index entries.
    """
    session.execute(_SERIALIZE_CLAIMERS, {"key": CLAIM_LOCK_KEY})
    rows = session.execute(
        _CLAIM,
        {
            "worker_id": worker_id,
            "batch_size": batch_size,
            "per_company_cap": per_company_cap,
            "stale_after": stale_after,
        },
    ).all()
    return [ClaimedTask(*row) for row in rows]


@dataclass(frozen=True)
class LostTask:
    """A task the poison-pill sweep failed because its workers kept dying."""

    id: uuid.UUID
    company_id: uuid.UUID
    type: str
    attempts: int
    locked_by: str | None


_FAIL_LOST = text(
    """
WITH lost AS (
    -- Served by ix_tasks_processing_locked_at, so running it before every claim is cheap.
    SELECT t.id, t.locked_by
    FROM tasks t
    WHERE t.status = 'processing'
      AND t.locked_at < now() - make_interval(secs => CAST(:stale_after AS float8))
      AND t.attempts >= t.max_attempts
    -- Bounded, so a mass crash costs each pass a slice, not one long statement.
    LIMIT :limit
    -- A row someone holds right now is being finalized or reclaimed; leave it to them.
    FOR UPDATE OF t SKIP LOCKED
)
UPDATE tasks t
SET status = 'failed',
    finished_at = now(),
    updated_at = now(),
    last_error = format('worker lost (lease expired) after %s attempts (last holder %s)',
                        t.attempts, coalesce(lost.locked_by, 'unknown')),
    lease_token = NULL,
    locked_by = NULL,
    locked_at = NULL
FROM lost
WHERE t.id = lost.id
RETURNING t.id, t.company_id, t.type, t.attempts, lost.locked_by
"""
)


def fail_lost_tasks(session: Session, *, stale_after: float, limit: int = 1000) -> list[LostTask]:
    """Fail up to `limit` stale `processing` tasks that have no attempts left; return them.

    DESIGN §4 Poison pills: a task whose worker died on its last attempt is not run again;
    it becomes `failed` with `last_error` saying the worker was lost. `stale_after` is in
    seconds, as for `claim`.
    """
    rows = session.execute(_FAIL_LOST, {"stale_after": stale_after, "limit": limit}).all()
    return [LostTask(*row) for row in rows]


def _clip_error(error: str) -> str:
    # text columns reject NUL; a message longer than this is noise, not information.
    error = error.replace("\x00", "\\0")
    if len(error) > MAX_ERROR_CHARS:
        error = error[: MAX_ERROR_CHARS - 1] + "\u2026"
    return error


def _rowcount(result: object) -> int:
    # Session.execute is typed as returning Result; for DML it is a CursorResult.
    assert isinstance(result, CursorResult)
    return result.rowcount


def _unzip(leases: Sequence[Lease]) -> dict[str, list[uuid.UUID]]:
    return {"ids": [lease.task_id for lease in leases], "tokens": [lease.token for lease in leases]}


_HEARTBEAT = text(
    """
UPDATE tasks t
SET locked_at = now()
FROM unnest(CAST(:ids AS uuid[]), CAST(:tokens AS uuid[])) AS held(id, token)
WHERE t.id = held.id
  -- Fenced: a lease another worker took over is theirs now; do not extend it.
  AND t.status = 'processing'
  AND t.lease_token = held.token
RETURNING t.id
"""
)


def heartbeat(session: Session, leases: Sequence[Lease]) -> set[uuid.UUID]:
    """Refresh `locked_at` of the tasks still held under these leases; return their ids.

    DESIGN §4 Heartbeat: keeps a long task from looking stale while its worker is alive.
    The count refreshed is `len()` of the result; ids missing from it lost their lease
    (taken over after expiry, or already finalized) and were not touched.
    """
    if not leases:
        return set()
    return set(session.scalars(_HEARTBEAT, _unzip(leases)))


# Every finalizer is fenced (DESIGN §1.4): it matches only while the caller still holds the
# lease. A miss means the lease was lost; nothing changes and the caller counts it.

_COMPLETE = text(
    """
UPDATE tasks t
SET status = 'completed', finished_at = now(), updated_at = now(), last_error = NULL,
    lease_token = NULL, locked_by = NULL, locked_at = NULL
FROM unnest(CAST(:ids AS uuid[]), CAST(:tokens AS uuid[])) AS held(id, token)
WHERE t.id = held.id AND t.status = 'processing' AND t.lease_token = held.token
RETURNING t.id
"""
)


def complete_tasks(session: Session, leases: Sequence[Lease]) -> set[uuid.UUID]:
    """Mark these held tasks `completed` in one statement; return the ids that matched.

    Ids missing from the result lost their lease and were left unchanged.
    """
    if not leases:
        return set()
    return set(session.scalars(_COMPLETE, _unzip(leases)))


def complete_task(session: Session, task_id: uuid.UUID, lease_token: uuid.UUID) -> bool:
    """Mark a held task `completed`; False (and nothing changed) when the lease was lost."""
    return bool(complete_tasks(session, [Lease(task_id, lease_token)]))


_FAIL = text(
    """
UPDATE tasks
SET status = 'failed', finished_at = now(), updated_at = now(), last_error = :error,
    lease_token = NULL, locked_by = NULL, locked_at = NULL
WHERE id = :id AND status = 'processing' AND lease_token = :token
"""
)


def fail_task(session: Session, task_id: uuid.UUID, lease_token: uuid.UUID, *, error: str) -> bool:
    """Mark a held task `failed` with `error` (clipped to `MAX_ERROR_CHARS`).

    Returns False, changing nothing, when the lease was lost.
    """
    result = session.execute(
        _FAIL, {"id": task_id, "token": lease_token, "error": _clip_error(error)}
    )
    return _rowcount(result) == 1


_RETRY_LATER = text(
    """
UPDATE tasks
SET status = 'pending',
    run_after = now() + make_interval(secs => CAST(:delay AS float8)),
    updated_at = now(), last_error = :error,
    lease_token = NULL, locked_by = NULL, locked_at = NULL
WHERE id = :id AND status = 'processing' AND lease_token = :token
"""
)


def schedule_retry(
    session: Session,
    task_id: uuid.UUID,
    lease_token: uuid.UUID,
    *,
    delay_seconds: float,
    error: str,
) -> bool:
    """Put a held task back to `pending`, runnable `delay_seconds` from now, with `error`.

    The delay comes from `worker.backoff`; attempts stay counted. Returns False, changing
    nothing, when the lease was lost.
    """
    result = session.execute(
        _RETRY_LATER,
        {
            "id": task_id,
            "token": lease_token,
            "delay": delay_seconds,
            "error": _clip_error(error),
        },
    )
    return _rowcount(result) == 1


_RELEASE = text(
    """
UPDATE tasks t
SET status = 'pending',
    attempts = t.attempts - 1,   -- it never started: this claim was not an attempt
    updated_at = now(),
    lease_token = NULL, locked_by = NULL, locked_at = NULL
    -- run_after untouched: a released task keeps its place in line.
FROM unnest(CAST(:ids AS uuid[]), CAST(:tokens AS uuid[])) AS held(id, token)
WHERE t.id = held.id AND t.status = 'processing' AND t.lease_token = held.token
RETURNING t.id
"""
)


def release_tasks(session: Session, leases: Sequence[Lease]) -> set[uuid.UUID]:
    """Hand back held tasks that were never started (shutdown); return the ids released.

    DESIGN §4 Release: back to `pending` with the attempt undone and `run_after` untouched.
    Ids missing from the result lost their lease and were left unchanged.
    """
    if not leases:
        return set()
    return set(session.scalars(_RELEASE, _unzip(leases)))
