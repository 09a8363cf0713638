"""Company (tenant) statements. Callers own the session and commit."""

from __future__ import annotations

import enum
import uuid
from typing import Any

from sqlalchemy import func, insert, select, text, update
from sqlalchemy.orm import Session

from db import errors, queue
from db.models import Company


class Unset(enum.Enum):
    """Marks a keyword argument the caller did not give (None is a value: "unlimited")."""

    UNSET = enum.auto()


UNSET = Unset.UNSET


def create_company(
    session: Session,
    *,
    name: str,
    weight: int = 1,
    max_in_flight: int | None = None,
    max_pending: int | None = None,
) -> Company:
    """Insert a company (its API keys: `db.api_keys.issue_key`, in the same transaction).

    `weight`, `max_in_flight` and `max_pending` (None: unlimited) default to the columns'
    defaults.
    """
    stmt = (
        insert(Company)
        .values(
            name=name,
            weight=weight,
            max_in_flight=max_in_flight,
            max_pending=max_pending,
        )
        .returning(Company)
    )
    return session.scalars(stmt).one()


def get_company(session: Session, company_id: uuid.UUID) -> Company:
    """The company with this id. Raises `errors.NotFound`."""
    company = session.get(Company, company_id)
    if company is None:
        raise errors.NotFound("company not found")
    return company


def update_company_limits(
    session: Session,
    company_id: uuid.UUID,
    *,
    weight: int | Unset = UNSET,
    max_in_flight: int | Unset | None = UNSET,
    max_pending: int | Unset | None = UNSET,
) -> Company:
    """Set the given limits of a company and return it; None is unlimited.

    One UPDATE ... RETURNING: no read-then-write race with another change. The bounds are
    the CHECK constraints `CK_COMPANY_WEIGHT`, `CK_COMPANY_MAX_IN_FLIGHT` and
    `CK_COMPANY_MAX_PENDING`; a value outside them raises `IntegrityError`. A `max_pending`
    below the current backlog refuses new tasks until it drains; nothing is dropped.
    Raises `errors.NotFound`, and `ValueError` when no limit is given.
    """
    values: dict[str, Any] = {}
    if not isinstance(weight, Unset):
        values["weight"] = weight
    if not isinstance(max_in_flight, Unset):
        values["max_in_flight"] = max_in_flight
    if not isinstance(max_pending, Unset):
        values["max_pending"] = max_pending
    if not values:
        raise ValueError("update_company_limits needs weight, max_in_flight or max_pending")
    stmt = (
        update(Company)
        .where(Company.id == company_id)
        .values(**values)
        .returning(Company)
        # An instance already in the session (e.g. loaded to authenticate) gets the new values.
        .execution_options(synchronize_session=False, populate_existing=True)
    )
    company = session.scalars(stmt).one_or_none()
    if company is None:
        raise errors.NotFound("company not found")
    return company


def _set_paused(session: Session, company_id: uuid.UUID, paused: bool) -> Company:
    # The trigger of migration 0006 copies `paused` to company_queues; pausing also takes the
    # company out of the ring (`ready = false`), and the claim's promotion passes it over.
    stmt = (
        update(Company)
        .where(Company.id == company_id)
        .values(paused=paused)
        .returning(Company)
        # An instance already in the session (e.g. loaded to authenticate) gets the new value.
        .execution_options(synchronize_session=False, populate_existing=True)
    )
    company = session.scalars(stmt).one_or_none()
    if company is None:
        raise errors.NotFound("company not found")
    return company


# The company's wake-up lock in shared mode, as the triggers that make a task pending take it
# (migration 0003; the claimer's `queue._TRY_WAKE_LOCKS` spells the same bucket).
_TAKE_WAKE_LOCK_SHARED = text(
    "SELECT pg_advisory_xact_lock_shared(CAST(:namespace AS int), "
    "hashtext(CAST(CAST(:company_id AS uuid) AS text)) & (CAST(:buckets AS int) - 1))"
)
# The claims' lock, exclusively: granted once every claim in flight has committed.
_WAIT_FOR_CLAIMERS = text("SELECT pg_advisory_xact_lock(CAST(:key AS bigint))")


def pause_company(session: Session, company_id: uuid.UUID) -> Company:
    """Stop the claim from taking the company's tasks; return the company (`paused` true).

    Its tasks are still accepted and kept; tasks already `processing` finish, retry or
    expire as usual and then wait. Idempotent. Commit right after: until then every claimer
    of the cluster waits. Raises `errors.NotFound`, and `RuntimeError` on a session in
    autocommit (the statements below must commit together).

    Once the caller's commit returns, no claim takes the company's tasks. Every claim holds
    the claims' advisory lock (`queue.CLAIM_LOCK_KEY`) shared until it commits
    (db/sql/claim.sql), so the pause takes it exclusively before it commits: a claim in
    flight has then committed first, and every later claim reads the ring after the pause.
    Three statements, in this order:

    1. the company's wake-up lock in shared mode, as a writer takes it (migration 0003): a
       claim in flight that finds the company short then leaves its row alone (its
       try-lock fails) rather than wait for the pause's row lock while the pause waits for
       it (a deadlock), or settle the paused company back into the ring;
    2. the UPDATE, whose trigger takes the company out of the ring;
    3. the claims' lock, last: claims never queue behind a pause that is itself waiting
       for a row lock (a transaction still open that wrote the company's rows).
    """
    _require_transaction(session, "pause_company")
    session.execute(
        _TAKE_WAKE_LOCK_SHARED,
        {
            "namespace": queue.WAKE_LOCK_NAMESPACE,
            "company_id": company_id,
            "buckets": queue.WAKE_LOCK_BUCKETS,
        },
    )
    company = _set_paused(session, company_id, True)
    session.execute(_WAIT_FOR_CLAIMERS, {"key": queue.CLAIM_LOCK_KEY})
    return company


def resume_company(
    session: Session, company_id: uuid.UUID, *, notify_channel: str | None = None
) -> Company:
    """Let the claim take the company's tasks again; return the company (`paused` false).

    Idempotent. Its runnable tasks are claimed in their usual order ("eligible since"), the
    company joining the ring at its end like any company whose work came due, with no credit
    kept from before the pause: the claim's promotion finds it through `due_at`, which the
    triggers kept a lower bound of its earliest pending `run_after` while it was paused.
    `NOTIFY notify_channel` (payload: the company id) wakes idle workers when the caller
    commits, as a create does. Raises `errors.NotFound`.
    """
    company = _set_paused(session, company_id, False)
    if notify_channel:
        session.execute(select(func.pg_notify(notify_channel, str(company_id))))
    return company


def _require_transaction(session: Session, what: str) -> None:
    driver = session.connection().connection.driver_connection
    if getattr(driver, "autocommit", False):
        # Each statement would commit on its own: the locks would end before the commit
        # they must cover.
        raise RuntimeError(f"{what} needs a transaction; the connection is in autocommit")
