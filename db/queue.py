"""The tenant's statements on tasks: create (one or a batch), read, list, cancel, retry.

The side of the state machine (design §4) that the API drives for a company. The worker's
side, the claim and every statement fenced by a lease token, is `db.claims`; the sweep that
takes back dead workers' leases is `db.workers`. Every write to `tasks` fires the triggers of
db/sql/tasks.sql (wake-up and backlog counts), whichever module sends it.

Every function takes a psycopg connection first and never commits: callers own the
transaction (`with conn.transaction():`) or run a single statement in autocommit. Statements
are plain SQL with `%(name)s` parameters (the connector: `db.connector`). Timestamps always come
from the database clock (`now()`), never from Python.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Sequence
from typing import Any, NamedTuple

import psycopg
from psycopg.types.json import Jsonb

from db import errors
from db.engine import driver_errors
from db.models import DEFAULT_TIMEOUT_SECONDS, TaskStatus


class TaskRecord(NamedTuple):
    """A task as the API returns it: the columns of `tasks` a client sees, plus `request_hash`.

    What `create_task`, `get_task` and `list_tasks` return, read straight from the driver's
    rows: the API's hot path builds no ORM object. Their statements select these columns in
    this order.
    """

    id: uuid.UUID
    company_id: uuid.UUID
    type: str
    payload: dict[str, Any]
    status: str
    attempts: int
    max_attempts: int
    timeout_seconds: int
    run_after: dt.datetime
    idempotency_key: str | None
    request_hash: str | None
    last_error: str | None
    created_at: dt.datetime
    updated_at: dt.datetime
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    result: Any


# One statement for the insert and the wake-up: the NOTIFY is sent only for a row inserted,
# and only when its transaction commits. The conflict arbiter is the partial unique index
# UQ_TASK_IDEMPOTENCY_KEY, named by its columns and predicate (ON CONFLICT ON CONSTRAINT takes
# constraints only); a NULL key never conflicts on it. A run_at in the past means "now": it
# must not jump ahead of work that has been runnable longer (the claim orders by
# eligible-since); greatest() ignores a NULL run_at.
# The columns of a `TaskRecord`, in its order.
_TASK_COLUMNS = ", ".join(TaskRecord._fields)

_INSERT_TASK = """
WITH created AS (
    INSERT INTO tasks (company_id, type, payload, status, max_attempts, timeout_seconds,
                       run_after, idempotency_key, request_hash)
    VALUES (%(company_id)s, %(type)s, %(payload)s, 'pending', %(max_attempts)s,
            %(timeout_seconds)s, greatest(CAST(%(run_at)s AS timestamptz), now()), %(key)s,
            %(request_hash)s)
    ON CONFLICT (company_id, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING {columns}
)
SELECT created.*,
       -- No channel, no wake-up (a NULL channel would be an error).
       CASE WHEN CAST(%(channel)s AS text) IS NOT NULL
            THEN CAST(pg_notify(CAST(%(channel)s AS text), CAST(company_id AS text)) AS text) END
FROM created
""".replace("{columns}", _TASK_COLUMNS)
_TASK_BY_KEY = """
SELECT {columns}
FROM tasks
WHERE company_id = %(company_id)s AND idempotency_key = %(key)s
""".replace("{columns}", _TASK_COLUMNS)
_TASK_BY_ID = """
SELECT {columns}
FROM tasks
WHERE id = %(id)s AND company_id = %(company_id)s
""".replace("{columns}", _TASK_COLUMNS)
# Absent filters are NULL parameters: one statement text, so psycopg prepares it once.
# Two ordered ranges merged, each cut at the page's end (`window` = offset + limit): the
# listing index, which leaves leased tasks out (migration 0009), and the company's leases
# (their own index, a few rows sorted). A condition on parameters alone is a one-time
# filter: a status filter skips the range that cannot hold it without reading it.
_LIST_TASKS = """
SELECT {columns}
FROM ((SELECT {columns}
       FROM tasks
       WHERE company_id = %(company_id)s AND status <> 'processing'
         AND CAST(%(status)s AS text) IS DISTINCT FROM 'processing'
         AND (CAST(%(status)s AS text) IS NULL OR status = CAST(%(status)s AS text))
         AND (CAST(%(type)s AS text) IS NULL OR type = CAST(%(type)s AS text))
       ORDER BY created_at DESC, id DESC
       LIMIT %(window)s)
      UNION ALL
      (SELECT {columns}
       FROM tasks
       WHERE company_id = %(company_id)s AND status = 'processing'
         AND coalesce(CAST(%(status)s AS text) = 'processing', true)
         AND (CAST(%(type)s AS text) IS NULL OR type = CAST(%(type)s AS text))
       ORDER BY created_at DESC, id DESC
       LIMIT %(window)s)) AS listed
ORDER BY created_at DESC, id DESC
LIMIT %(limit)s OFFSET %(offset)s
""".replace("{columns}", _TASK_COLUMNS)
_FIELDS = len(TaskRecord._fields)


def _record(row: Sequence[Any]) -> TaskRecord:
    return TaskRecord._make(row[:_FIELDS])


def create_task(
    conn: psycopg.Connection[Any],
    *,
    company_id: uuid.UUID,
    type: str,
    payload: dict[str, Any],
    run_at: dt.datetime | None = None,
    max_attempts: int = 5,
    timeout_seconds: int = DEFAULT_TIMEOUT_SECONDS,
    idempotency_key: str | None = None,
    request_hash: str | None = None,
    notify_channel: str | None = None,
) -> tuple[TaskRecord, bool]:
    """Insert a pending task and wake idle workers; return `(task, created)`.

    With an `idempotency_key`, a concurrent or earlier request with the same key resolves
    through the unique constraint (`INSERT ... ON CONFLICT DO NOTHING`, then read): the
    existing task is returned with `created=False`, or `errors.IdempotencyKeyReused` is raised
    when its `request_hash` differs (IETF Idempotency-Key draft, section 2.7).
    `NOTIFY notify_channel` is sent by the insert's own statement, in the caller's
    transaction, so it fires only on commit. A new task costs one statement.
    """
    params: dict[str, Any] = {
        "company_id": company_id,
        "type": type,
        "payload": Jsonb(payload),
        "max_attempts": max_attempts,
        "timeout_seconds": timeout_seconds,
        "run_at": run_at,
        "key": idempotency_key,
        "request_hash": request_hash,
        "channel": notify_channel or None,
    }
    # The conflicting row can vanish between the INSERT and the read (retention deleted it,
    # or its inserter rolled back): then the key is free again, so insert once more.
    for _ in range(_CREATE_ATTEMPTS):
        with driver_errors("create_task"):
            row = conn.execute(_INSERT_TASK, params).fetchone()
        if row is not None:
            return _record(row), True
        existing = _existing_for_key(conn, company_id, idempotency_key)
        if existing is not None:
            if existing.request_hash != request_hash:
                raise errors.IdempotencyKeyReused(
                    "this Idempotency-Key was already used with a different request body"
                )
            return existing, False
    raise errors.IdempotencyKeyInFlux("the Idempotency-Key is in flux (created and deleted); retry")


# INSERT/read rounds before giving up on a key whose row keeps disappearing.
_CREATE_ATTEMPTS = 3


def _existing_for_key(
    conn: psycopg.Connection[Any], company_id: uuid.UUID, key: str | None
) -> TaskRecord | None:
    # READ COMMITTED: ON CONFLICT waited for the other inserter to commit, so this new
    # statement sees its row, unless it was deleted in between.
    with driver_errors("task_by_key"):
        row = conn.execute(_TASK_BY_KEY, {"company_id": company_id, "key": key}).fetchone()
    return None if row is None else _record(row)


class NewTask(NamedTuple):
    """One task for `create_tasks`: what a create sets, as `create_task` takes it."""

    type: str
    payload: dict[str, Any]
    run_at: dt.datetime | None
    max_attempts: int
    timeout_seconds: int
    idempotency_key: str | None
    request_hash: str | None


# The batch's one statement: rows from parallel arrays zipped by ROWS FROM (one parameter per
# column whatever the count; the payloads as one JSON array, which psycopg dumps several times
# faster than a jsonb[]), `_INSERT_TASK`'s insert and conflict rule, and one NOTIFY if a row
# was inserted. Then, per item: the row it inserted (created), or the row that already held
# its key in the statement's snapshot (a replay), with the item's number (`n`, from 1). An
# item in neither lost its key to a create that committed after the snapshot began;
# `create_tasks` sends it again. Parameters go in binary (`%(...)b`).
# Ids (time-ordered, but random within a millisecond: migration 0008) are handed out in
# ascending order: the claim breaks ties in run_after by id, so a batch created at one now()
# runs in request order, and lists like single creates.
_INSERT_TASKS = """
WITH items AS MATERIALIZED (
    SELECT i.n, ids.id, i.type, i.payload, i.run_at, i.max_attempts, i.timeout_seconds,
           i.key, i.request_hash
    FROM ROWS FROM (unnest(CAST(%(types)b AS text[])),
                    jsonb_array_elements(CAST(%(payloads)b AS jsonb)),
                    unnest(CAST(%(run_ats)b AS timestamptz[])),
                    unnest(CAST(%(max_attempts)b AS int[])),
                    unnest(CAST(%(timeouts)b AS int[])),
                    unnest(CAST(%(keys)b AS text[])),
                    unnest(CAST(%(request_hashes)b AS text[])))
         WITH ORDINALITY
         AS i(type, payload, run_at, max_attempts, timeout_seconds, key, request_hash, n)
    JOIN (SELECT row_number() OVER (ORDER BY g.id) AS n, g.id
          FROM (SELECT fairq_uuidv7() AS id
                FROM generate_series(1, cardinality(CAST(%(types)b AS text[])))) g) ids
      ON ids.n = i.n
),
created AS (
    INSERT INTO tasks (id, company_id, type, payload, status, max_attempts, timeout_seconds,
                       run_after, idempotency_key, request_hash)
    SELECT i.id, %(company_id)b, i.type, i.payload, 'pending', i.max_attempts,
           i.timeout_seconds, greatest(i.run_at, now()), i.key, i.request_hash
    FROM items i
    -- Keys in one order for every batch: two batches sharing keys wait on each other's
    -- rows in the unique index one way only, never in a cycle (a deadlock).
    ORDER BY i.key, i.n
    ON CONFLICT (company_id, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING {columns}
),
existing AS (
    -- Items whose key was taken: the row that holds it, as the statement's snapshot shows it
    -- (committed before the statement began). One probe of the unique index per such item,
    -- none when every row went in: LIMIT 1 keeps the subquery a probe per item whatever
    -- the statistics say (a burst of keyed inserts that ANALYZE has not seen made a merge
    -- join read all of the company's keyed rows).
    SELECT i.n, e.*
    FROM items i
    CROSS JOIN LATERAL (
        SELECT {columns_of_t}
        FROM tasks t
        WHERE t.company_id = %(company_id)b AND t.idempotency_key = i.key
        LIMIT 1
    ) e
    WHERE i.key IS NOT NULL AND NOT EXISTS (SELECT FROM created c WHERE c.id = i.id)
),
woken AS MATERIALIZED (
    -- Read once, by the join below, and only when a row was inserted: one NOTIFY.
    SELECT pg_notify(CAST(%(channel)b AS text), CAST(%(company_id)b AS text))
    WHERE CAST(%(channel)b AS text) IS NOT NULL AND EXISTS (SELECT FROM created)
)
SELECT i.n, true AS created, c.*
FROM created c
JOIN items i ON i.id = c.id
LEFT JOIN woken ON true
UNION ALL
SELECT e.n, false AS created, {columns}
FROM existing e
""".replace("{columns}", _TASK_COLUMNS).replace(
    "{columns_of_t}", ", ".join(f"t.{name}" for name in TaskRecord._fields)
)


def create_tasks(
    conn: psycopg.Connection[Any],
    *,
    company_id: uuid.UUID,
    tasks: Sequence[NewTask],
    notify_channel: str | None = None,
) -> list[tuple[TaskRecord, bool]]:
    """Insert pending tasks in one statement and wake idle workers once; `(task, created)` each.

    In the order of `tasks`, and as if each had been created alone with `create_task`, in
    that order: an item whose `idempotency_key` is already taken returns the task holding it
    with `created=False`, and so does a later item repeating an earlier one's key (the same
    task). A key whose task was made from another `request_hash` raises
    `errors.IdempotencyKeyReused` naming the item (`tasks[i]`, 0-based), so does a key
    repeated with another hash (raised before any SQL).

    One statement per batch, whatever its size (`_INSERT_TASKS`); a second only for keys that
    a concurrent create committed meanwhile (at most `_CREATE_ATTEMPTS` in all, then
    `errors.Conflict`). Sent to psycopg directly, in binary both ways, like the claim: on a
    thousand tasks the text forms cost more than the insert. Needs a transaction (a
    `RuntimeError` in autocommit): the batch is all or nothing only if the caller rolls it
    back on an error, as rows inserted before a raise stay in it. The backlog quota's
    trigger refuses the statement whole (SQLSTATE `models.BACKLOG_QUOTA_SQLSTATE`) when its
    inserts do not fit.
    """
    first_with_key: dict[str, int] = {}
    repeats: dict[int, int] = {}
    for index, task in enumerate(tasks):
        if task.idempotency_key is None:
            continue
        first = first_with_key.setdefault(task.idempotency_key, index)
        if first != index:
            if tasks[first].request_hash != task.request_hash:
                raise errors.IdempotencyKeyReused(
                    f"tasks[{index}] repeats the Idempotency-Key of tasks[{first}] "
                    "with a different request body",
                    item=index,
                )
            repeats[index] = first
    found: dict[int, tuple[TaskRecord, bool]] = {}
    todo = [index for index in range(len(tasks)) if index not in repeats]
    with driver_errors("create_tasks"):
        if conn.autocommit and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
            # Each statement would be a transaction of its own: a batch is all or nothing.
            raise RuntimeError("this needs a transaction; the connection is in autocommit")
        for _ in range(_CREATE_ATTEMPTS):
            for row in _insert_tasks(conn, company_id, [tasks[i] for i in todo], notify_channel):
                index = todo[row[0] - 1]  # n counts the items sent, from 1
                record, created = TaskRecord._make(row[2 : 2 + _FIELDS]), bool(row[1])
                if not created and record.request_hash != tasks[index].request_hash:
                    raise errors.IdempotencyKeyReused(
                        f"tasks[{index}]: this Idempotency-Key was already used with a "
                        "different request body",
                        item=index,
                    )
                found[index] = (record, created)
            todo = [index for index in todo if index not in found]
            if not todo:
                break
        else:
            raise errors.IdempotencyKeyInFlux(
                f"tasks[{todo[0]}]: its Idempotency-Key is in flux (created and deleted); retry",
                item=todo[0],
            )
    for index, first in repeats.items():
        found[index] = (found[first][0], False)
    return [found[index] for index in range(len(tasks))]


def _insert_tasks(
    driver: psycopg.Connection[Any],
    company_id: uuid.UUID,
    tasks: Sequence[NewTask],
    notify_channel: str | None,
) -> list[tuple[Any, ...]]:
    # prepare=False: planned with the arrays' real lengths each time. A generic plan (psycopg
    # prepares a statement run 5 times) could join two CTEs of a thousand rows in a nested loop.
    params = {
        "company_id": company_id,
        "types": [task.type for task in tasks],
        "payloads": Jsonb([task.payload for task in tasks]),
        "run_ats": [task.run_at for task in tasks],
        "max_attempts": [task.max_attempts for task in tasks],
        "timeouts": [task.timeout_seconds for task in tasks],
        "keys": [task.idempotency_key for task in tasks],
        "request_hashes": [task.request_hash for task in tasks],
        "channel": notify_channel or None,
    }
    cursor = driver.cursor(binary=True)
    return cursor.execute(_INSERT_TASKS, params, prepare=False).fetchall()


def get_task(
    conn: psycopg.Connection[Any], company_id: uuid.UUID, task_id: uuid.UUID
) -> TaskRecord:
    """The company's task. Raises `errors.NotFound` if absent or owned by another company."""
    with driver_errors("get_task"):
        row = conn.execute(_TASK_BY_ID, {"id": task_id, "company_id": company_id}).fetchone()
    if row is None:
        raise errors.NotFound("task not found")
    return _record(row)


def list_tasks(
    conn: psycopg.Connection[Any],
    company_id: uuid.UUID,
    *,
    status: str | None = None,
    type: str | None = None,
    limit: int = 20,
    offset: int = 0,
) -> tuple[list[TaskRecord], bool]:
    """One page of the company's tasks, newest first; return `(items, has_more)`.

    Ordered by `(created_at DESC, id DESC)`: `ix_tasks_company_listing_unleased` merged
    with the company's leases.
    """
    params = {
        "company_id": company_id, "status": status, "type": type,
        "limit": limit + 1, "offset": offset, "window": offset + limit + 1,
    }  # fmt: skip
    with driver_errors("list_tasks"):
        rows = [_record(row) for row in conn.execute(_LIST_TASKS, params)]
    return rows[:limit], len(rows) > limit


# One conditional UPDATE: no read-then-write race with a claimer. `{set}`: the transition's
# columns; the statuses it may leave are a parameter.
_TRANSITION = """
UPDATE tasks
SET updated_at = now(), {set}
WHERE id = %(id)s AND company_id = %(company_id)s AND status = ANY(%(from_statuses)s)
RETURNING {columns}
""".replace("{columns}", _TASK_COLUMNS)
_CANCEL = _TRANSITION.replace("{set}", "status = 'cancelled', finished_at = now()")
_RETRY = _TRANSITION.replace(
    "{set}",
    "status = 'pending', attempts = 0, run_after = now(), finished_at = NULL, "
    "lease_token = NULL, locked_by = NULL, locked_at = NULL",
)


def _transition(
    conn: psycopg.Connection[Any],
    statement: str,
    company_id: uuid.UUID,
    task_id: uuid.UUID,
    *,
    from_statuses: Sequence[TaskStatus],
    action: str,
) -> TaskRecord:
    params = {
        "id": task_id,
        "company_id": company_id,
        "from_statuses": [s.value for s in from_statuses],
    }
    with driver_errors(action):
        row = conn.execute(statement, params).fetchone()
    if row is not None:
        return _record(row)
    current = get_task(conn, company_id, task_id)  # raises NotFound
    allowed = " or ".join(s.value for s in from_statuses)
    raise errors.Conflict(f"cannot {action} a task in status {current.status!r} (only {allowed})")


def cancel_task(
    conn: psycopg.Connection[Any], company_id: uuid.UUID, task_id: uuid.UUID
) -> TaskRecord:
    """Move a pending task to `cancelled`.

    Raises `errors.NotFound`, or `errors.Conflict` when it is not pending.
    """
    return _transition(
        conn, _CANCEL, company_id, task_id, from_statuses=(TaskStatus.PENDING,), action="cancel"
    )


def retry_task(
    conn: psycopg.Connection[Any], company_id: uuid.UUID, task_id: uuid.UUID
) -> TaskRecord:
    """Move a failed or cancelled task back to `pending`, runnable now, with attempts reset.

    Raises `errors.NotFound`, or `errors.Conflict` from any other status.
    """
    return _transition(
        conn,
        _RETRY,
        company_id,
        task_id,
        from_statuses=(TaskStatus.FAILED, TaskStatus.CANCELLED),
        action="retry",
    )
