"""The claim and every statement fenced by a lease token: the worker's side (design §1.4, §4).

A worker claims tasks with `claim`, which runs the whole claim in the server (`fairq_claim`,
db/sql/claim.sql; its model of deficit round robin is pure Python in `db.fair_share`), and
ends each lease with one fenced statement: `complete_tasks`, `fail_task`, `schedule_retry` or
`release_tasks`. A fenced statement matches only while the caller still holds the lease, and
changes nothing once it was lost. The tenant's statements on tasks are `db.queue`; the sweep
that takes back dead workers' leases is `db.workers`.

Every function takes a psycopg connection first and never commits: callers own the
transaction (`with conn.transaction():`) or run a single statement in autocommit. Statements
are plain SQL with `%(name)s` parameters (the connector: `db.connector`). Timestamps always come
from the database clock (`now()`), never from Python.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, TypeVar

import psycopg
from psycopg.rows import args_row

from db.engine import driver_errors

# Key of the transaction-scoped advisory lock every claim holds shared until it commits and a
# pause takes exclusively ("fairqcl" in ASCII; db/sql/claim.sql spells the same number).
CLAIM_LOCK_KEY = 0x66_61_69_72_71_63_6C

# A company's wake-up lock: (namespace, hashtext(company_id) & (buckets - 1)). Writers that
# make a task pending hold it shared (the triggers of db/sql/tasks.sql, which spell the same
# numbers); the claimer takes it exclusively before it marks a company as out of runnable
# work (db/sql/claim.sql). Buckets bound the locks a statement over many companies takes.
WAKE_LOCK_NAMESPACE = 0x66_71_77_6B
WAKE_LOCK_BUCKETS = 64

# `last_error` is for humans; a handler's error can be arbitrarily long.
MAX_ERROR_CHARS = 2000


class Held(Protocol):
    """A task whose lease a caller holds, as every fenced statement takes it: its `id` and
    the `lease_token` it was claimed with (a `ClaimedTask`, or a `Lease`)."""

    @property
    def id(self) -> uuid.UUID:
        """The task's id."""
        ...

    @property
    def lease_token(self) -> uuid.UUID:
        """The fencing token of its lease."""
        ...


class Lease(NamedTuple):
    """A held task known by its id and fencing token only (one not claimed by this process)."""

    id: uuid.UUID
    lease_token: uuid.UUID


class ClaimedTask(NamedTuple):
    """A row the claim moved to `processing`, as the processing pass needs it; it is `Held`.

    `attempts` already counts this attempt (1 on the first run). A tuple: a claim builds a
    hundred of these, and a frozen dataclass costs several times more to construct.
    """

    id: uuid.UUID
    company_id: uuid.UUID
    type: str
    payload: dict[str, Any]
    attempts: int
    max_attempts: int
    lease_token: uuid.UUID
    created_at: dt.datetime
    timeout_seconds: int  # how long this attempt may run, in seconds


# Waiting companies made ready per claim at most (db/sql/claim.sql): a mass wake-up is spread
# over claims.
PROMOTE_LIMIT = 1000

# The whole claim, in the server (migration 0011, db/sql/claim.sql).
_CLAIM = "SELECT * FROM fairq_claim(%(worker_id)s, %(batch_size)s)"


def claim(
    conn: psycopg.Connection[Any],
    *,
    worker_id: str,
    batch_size: int,
    commit: Callable[[], None] | None = None,
) -> list[ClaimedTask]:
    """Claim up to `batch_size` runnable tasks, weighted-fair across companies; in claim order.

    Runnable: `pending` with `run_after` at or before the claim's statement time, of a
    company not paused (leases of dead workers are made pending by `workers.take_back_leases`). Each
    claimed row moves to `processing` with a new `lease_token` and counts an attempt. Run it
    under READ COMMITTED (the default), in autocommit (one round trip: the statement is its
    own transaction) or in a transaction committed right after: until then a pause waits,
    and so do later claims of the batch's companies that have a `max_in_flight`.

    One statement, `fairq_claim` (db/sql/claim.sql): companies take turns in ring order from
    the cluster's one cursor, each up to its `weight` tasks a turn (deficit round robin, the
    model in `fair_share.allocate`), and within a company its longest-waiting tasks, by
    `run_after` ("eligible since"). Claimers take their stretches of turns one at a time but
    claim them in parallel (decision 0007). Work-conserving: fewer than `batch_size` only when
    no more runnable task is allowed (a company at its `max_in_flight` holds back the rest of
    its work), or is held by a claim still in flight. The cost depends on the batch size, not
    on how many companies exist or have work (docs/design.md, "The claim").

    `commit`, if given, ends the transaction (`conn.commit`) right after the statement,
    before the rows are decoded. Without it the caller commits. Raises `DBAPIError`.
    """
    with driver_errors("claim"):
        cursor = conn.cursor(row_factory=_CLAIMED_TASKS).execute(
            _CLAIM, {"worker_id": worker_id, "batch_size": batch_size}
        )
        if commit is not None:
            commit()
        # A cursor keeps its result after the commit: decoding needs no server.
        return cursor.fetchall()


# Each row of the claim made into a `ClaimedTask` as psycopg reads it (columns in its order).
_CLAIMED_TASKS = args_row(ClaimedTask)


def _clip_error(error: str) -> str:
    # text columns reject NUL; a message longer than this is noise, not information.
    error = error.replace("\x00", "\\0")
    if len(error) > MAX_ERROR_CHARS:
        error = error[: MAX_ERROR_CHARS - 1] + "\u2026"
    return error


# Any kind of held task; a fenced statement returns the caller's own objects.
_H = TypeVar("_H", bound=Held)


def _unzip(tasks: Sequence[Held]) -> dict[str, list[uuid.UUID]]:
    return {"ids": [task.id for task in tasks], "tokens": [task.lease_token for task in tasks]}


def _lost(tasks: Sequence[_H], cursor: psycopg.Cursor[Any]) -> list[_H]:
    """Which of `tasks` a fenced statement's `RETURNING t.id` left out: their lease was lost."""
    if cursor.rowcount == len(tasks):  # the common case: every lease still held
        return []
    matched = {row[0] for row in cursor}
    return [task for task in tasks if task.id not in matched]


# The fenced statements over a set of leases match `t.id = ANY(ids) AND t.lease_token =
# ANY(tokens)`: primary-key probes, whatever the plan. A join with unnest(ids, tokens), once
# the prepared statement had a generic plan and statistics counted few processing rows, could
# scan the processing index once per lease (a completion of 100 tasks of 50 companies took
# 2.9-3.1 ms instead of 1.9-2.0; decision 0002). Pairs need no join: a lease token is made
# for one task's attempt only (gen_random_uuid()), so a task whose token is among ours is
# one whose lease we hold.
_HELD = "t.id = ANY(CAST({ids} AS uuid[])) AND t.lease_token = ANY(CAST({tokens} AS uuid[]))"
# The rows' status, not in the words of the processing indexes' predicate: with the literal
# `t.status = 'processing'` the planner scanned a processing index and filtered it by id, and
# while a snapshot held elsewhere keeps the entries of every task finished since, that scan
# grew with them (decision 0012). status is NOT NULL: coalesce changes no result.
_PROCESSING = "coalesce(t.status, '') = 'processing'"

# Every finalizer is fenced (design §1.4): it matches only while the caller still holds the
# lease. A miss means the lease was lost; nothing changes and the caller counts it.

_COMPLETE = """
UPDATE tasks t
SET status = 'completed', finished_at = now(), updated_at = now(), last_error = NULL,
    lease_token = NULL, locked_by = NULL, locked_at = NULL
WHERE {held} AND {processing}
RETURNING t.id
""".replace("{processing}", _PROCESSING).replace(
    "{held}", _HELD.format(ids="%(ids)b", tokens="%(tokens)b")
)
# The same with each task's result, JSON text parsed by the server (NULL: none), found by the
# task's place in `ids`. A statement of its own, so a batch without results (noop, most
# handlers) sends and plans nothing more.
_COMPLETE_WITH_RESULTS = """
UPDATE tasks t
SET status = 'completed', finished_at = now(), updated_at = now(), last_error = NULL,
    lease_token = NULL, locked_by = NULL, locked_at = NULL,
    result = CAST((CAST(%(results)b AS text[]))[array_position(CAST(%(ids)b AS uuid[]), t.id)]
                  AS jsonb)
WHERE {held} AND {processing}
RETURNING t.id
""".replace("{processing}", _PROCESSING).replace(
    "{held}", _HELD.format(ids="%(ids)b", tokens="%(tokens)b")
)


def complete_tasks(
    conn: psycopg.Connection[Any],
    tasks: Sequence[_H],
    results: Sequence[str | None] | None = None,
) -> list[_H]:
    """Mark these held tasks `completed` in one statement; return those whose lease was lost.

    `results`, if given, pairs with `tasks`: the JSON text stored as each task's `result`
    (None: no result). Each must be JSON that `jsonb` accepts (no `\\u0000` escape): one
    refused fails the whole statement, so the worker checks every result first
    (`worker.processing.task_result`). A task returned lost its lease and was left unchanged.
    Sent to psycopg directly, with binary arrays, like the claim: it is a worker's other
    statement per batch.
    """
    if not tasks:
        return []
    with driver_errors("complete_tasks"):
        if results is None or all(result is None for result in results):
            cursor = conn.execute(_COMPLETE, _unzip(tasks))
        else:
            if len(results) != len(tasks):
                raise ValueError(f"{len(results)} results for {len(tasks)} tasks")
            cursor = conn.execute(
                _COMPLETE_WITH_RESULTS, {**_unzip(tasks), "results": list(results)}
            )
        return _lost(tasks, cursor)


_FAIL = """
UPDATE tasks
SET status = 'failed', finished_at = now(), updated_at = now(), last_error = %(error)s,
    lease_token = NULL, locked_by = NULL, locked_at = NULL
WHERE id = %(id)s AND status = 'processing' AND lease_token = %(token)s
"""


def fail_task(
    conn: psycopg.Connection[Any], task_id: uuid.UUID, lease_token: uuid.UUID, *, error: str
) -> bool:
    """Mark a held task `failed` with `error` (clipped to `MAX_ERROR_CHARS`).

    Returns False, changing nothing, when the lease was lost.
    """
    params = {"id": task_id, "token": lease_token, "error": _clip_error(error)}
    with driver_errors("fail_task"):
        return conn.execute(_FAIL, params).rowcount == 1


_RETRY_LATER = """
UPDATE tasks
SET status = 'pending',
    run_after = now() + make_interval(secs => CAST(%(delay)s AS float8)),
    updated_at = now(), last_error = %(error)s,
    lease_token = NULL, locked_by = NULL, locked_at = NULL
WHERE id = %(id)s AND status = 'processing' AND lease_token = %(token)s
"""


def schedule_retry(
    conn: psycopg.Connection[Any],
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
    params = {
        "id": task_id,
        "token": lease_token,
        "delay": delay_seconds,
        "error": _clip_error(error),
    }
    with driver_errors("schedule_retry"):
        return conn.execute(_RETRY_LATER, params).rowcount == 1


_RELEASE = """
UPDATE tasks t
SET status = 'pending',
    attempts = t.attempts - 1,   -- it never started: this claim was not an attempt
    updated_at = now(),
    lease_token = NULL, locked_by = NULL, locked_at = NULL
    -- run_after untouched: a released task keeps its place in line.
WHERE {held} AND {processing}
RETURNING t.id
""".replace("{processing}", _PROCESSING).replace(
    "{held}", _HELD.format(ids="%(ids)s", tokens="%(tokens)s")
)


def release_tasks(conn: psycopg.Connection[Any], tasks: Sequence[_H]) -> list[_H]:
    """Hand back held tasks that were never started (shutdown); return those whose lease was
    lost (left unchanged).

    design §4 Release: back to `pending` with the attempt undone and `run_after` untouched.
    """
    if not tasks:
        return []
    with driver_errors("release_tasks"):
        return _lost(tasks, conn.execute(_RELEASE, _unzip(tasks)))
