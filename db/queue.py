"""Every statement that reads or moves tasks through the state machine (DESIGN §4).

Callers own the session and commit; functions here never commit. Timestamps always come
from the database clock (`now()`), never from Python.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, select, update
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
    type: str,  # noqa: A002  (the column's name)
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
        "run_after": run_at if run_at is not None else func.now(),
        "idempotency_key": idempotency_key,
        "request_hash": request_hash,
    }
    stmt = pg_insert(Task).values(**values)
    if idempotency_key is not None:
        stmt = stmt.on_conflict_do_nothing(constraint=UQ_TASK_IDEMPOTENCY_KEY)
    task = session.scalars(stmt.returning(Task)).one_or_none()
    if task is None:
        return _existing_for_key(session, company_id, idempotency_key, request_hash), False
    if notify_channel:
        session.execute(select(func.pg_notify(notify_channel, str(task.company_id))))
    return task, True


def _existing_for_key(
    session: Session, company_id: uuid.UUID, key: str | None, request_hash: str | None
) -> Task:
    # READ COMMITTED: ON CONFLICT waited for the other inserter to commit, so this new
    # statement sees its row.
    existing = session.scalars(
        select(Task).where(Task.company_id == company_id, Task.idempotency_key == key)
    ).one()
    if existing.request_hash != request_hash:
        raise errors.IdempotencyKeyReused(
            "this Idempotency-Key was already used with a different request body"
        )
    return existing


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
    type: str | None = None,  # noqa: A002  (the column's name)
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
        (TaskStatus.PENDING,),
        {"status": TaskStatus.CANCELLED.value, "finished_at": func.now()},
        "cancel",
    )


def retry_task(session: Session, company_id: uuid.UUID, task_id: uuid.UUID) -> Task:
    """Move a failed or cancelled task back to `pending`, runnable now, with attempts reset.

    Raises `errors.NotFound`, or `errors.Conflict` from any other status.
    """
    return _transition(
        session,
        company_id,
        task_id,
        (TaskStatus.FAILED, TaskStatus.CANCELLED),
        {
            "status": TaskStatus.PENDING.value,
            "attempts": 0,
            "run_after": func.now(),
            "finished_at": None,
            "lease_token": None,
            "locked_by": None,
            "locked_at": None,
        },
        "retry",
    )
