"""Company (tenant) statements. Functions take a psycopg connection and never commit."""

from __future__ import annotations

import datetime as dt
import enum
import uuid
from dataclasses import dataclass, fields
from typing import Any

import psycopg
from psycopg.rows import class_row

from db import claims, errors
from db.engine import driver_errors


@dataclass(frozen=True)
class CompanyRecord:
    """A company as the API and the dashboard show it: the columns of `companies`, in the
    order `_COMPANY_COLUMNS` selects them (its API keys: `db.api_keys`)."""

    id: uuid.UUID
    name: str
    created_at: dt.datetime
    weight: int
    max_in_flight: int | None
    max_pending: int | None
    paused: bool


_COMPANY_COLUMNS = ", ".join(field.name for field in fields(CompanyRecord))


class Unset(enum.Enum):
    """Marks a keyword argument the caller did not give (None is a value: "unlimited")."""

    UNSET = enum.auto()


UNSET = Unset.UNSET


_INSERT_COMPANY = """
INSERT INTO companies (name, weight, max_in_flight, max_pending)
VALUES (%(name)s, %(weight)s, %(max_in_flight)s, %(max_pending)s)
RETURNING {columns}
""".replace("{columns}", _COMPANY_COLUMNS)
_COMPANY_BY_ID = "SELECT {columns} FROM companies WHERE id = %(id)s".replace(
    "{columns}", _COMPANY_COLUMNS
)


def create_company(
    conn: psycopg.Connection[Any],
    *,
    name: str,
    weight: int = 1,
    max_in_flight: int | None = None,
    max_pending: int | None = None,
) -> CompanyRecord:
    """Insert a company (its API keys: `db.api_keys.issue_key`, in the same transaction).

    `weight` defaults to the column's default; `max_in_flight` and `max_pending` (None:
    unlimited) too.
    """
    params = {
        "name": name,
        "weight": weight,
        "max_in_flight": max_in_flight,
        "max_pending": max_pending,
    }
    with driver_errors("create_company"):
        company = _company_cursor(conn).execute(_INSERT_COMPANY, params).fetchone()
    assert company is not None  # an INSERT without a conflict clause returns its row
    return company


def get_company(conn: psycopg.Connection[Any], company_id: uuid.UUID) -> CompanyRecord:
    """The company with this id. Raises `errors.NotFound`."""
    with driver_errors("get_company"):
        company = _company_cursor(conn).execute(_COMPANY_BY_ID, {"id": company_id}).fetchone()
    if company is None:
        raise errors.NotFound("company not found")
    return company


def _company_cursor(conn: psycopg.Connection[Any]) -> psycopg.Cursor[CompanyRecord]:
    return conn.cursor(row_factory=class_row(CompanyRecord))


def update_company_limits(
    conn: psycopg.Connection[Any],
    company_id: uuid.UUID,
    *,
    weight: int | Unset = UNSET,
    max_in_flight: int | Unset | None = UNSET,
    max_pending: int | Unset | None = UNSET,
) -> CompanyRecord:
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
    params = {
        "id": company_id,
        **{f"set_{name}": name in values for name in _LIMITS},
        **{name: values.get(name) for name in _LIMITS},
    }
    return _one_company(conn, _UPDATE_LIMITS, params, "update_company_limits")


_LIMITS = ("weight", "max_in_flight", "max_pending")
# One statement text whatever the limits given: a limit not given keeps its value.
_UPDATE_LIMITS = """
UPDATE companies
SET weight = CASE WHEN %(set_weight)s THEN %(weight)s ELSE weight END,
    max_in_flight = CASE WHEN %(set_max_in_flight)s THEN %(max_in_flight)s ELSE max_in_flight END,
    max_pending = CASE WHEN %(set_max_pending)s THEN %(max_pending)s ELSE max_pending END
WHERE id = %(id)s
RETURNING {columns}
""".replace("{columns}", _COMPANY_COLUMNS)
_SET_PAUSED = """
UPDATE companies SET paused = %(paused)s WHERE id = %(id)s RETURNING {columns}
""".replace("{columns}", _COMPANY_COLUMNS)


def _one_company(
    conn: psycopg.Connection[Any], statement: str, params: dict[str, Any], what: str
) -> CompanyRecord:
    with driver_errors(what):
        company = _company_cursor(conn).execute(statement, params).fetchone()
    if company is None:
        raise errors.NotFound("company not found")
    return company


def _set_paused(
    conn: psycopg.Connection[Any], company_id: uuid.UUID, paused: bool
) -> CompanyRecord:
    # The trigger of migration 0006 copies `paused` to company_queues; pausing also takes the
    # company out of the ring (`ready = false`), and the claim's promotion passes it over.
    return _one_company(conn, _SET_PAUSED, {"id": company_id, "paused": paused}, "set_paused")


# The company's wake-up lock in shared mode, as the triggers that make a task pending take it
# (migration 0003; the claimer's try-locks in db/sql/claim.sql spell the same bucket).
_TAKE_WAKE_LOCK_SHARED = (
    "SELECT pg_advisory_xact_lock_shared(CAST(%(namespace)s AS int), "
    "hashtext(CAST(CAST(%(company_id)s AS uuid) AS text)) & (CAST(%(buckets)s AS int) - 1))"
)
# The claims' lock, exclusively: granted once every claim in flight has committed.
_WAIT_FOR_CLAIMERS = "SELECT pg_advisory_xact_lock(CAST(%(key)s AS bigint))"


def pause_company(conn: psycopg.Connection[Any], company_id: uuid.UUID) -> CompanyRecord:
    """Stop the claim from taking the company's tasks; return the company (`paused` true).

    Its tasks are still accepted and kept; tasks already `processing` finish, retry or
    expire as usual and then wait. Idempotent. Commit right after: until then every claimer
    of the cluster waits. Raises `errors.NotFound`, and `RuntimeError` on a connection in
    autocommit outside a transaction (the statements below must commit together).

    Once the caller's commit returns, no claim takes the company's tasks. Every claim holds
    the claims' advisory lock (`claims.CLAIM_LOCK_KEY`) shared until it commits
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
    _require_transaction(conn, "pause_company")
    wake_lock = {
        "namespace": claims.WAKE_LOCK_NAMESPACE,
        "company_id": company_id,
        "buckets": claims.WAKE_LOCK_BUCKETS,
    }
    with driver_errors("pause_company"):
        conn.execute(_TAKE_WAKE_LOCK_SHARED, wake_lock)
    company = _set_paused(conn, company_id, True)
    with driver_errors("pause_company"):
        conn.execute(_WAIT_FOR_CLAIMERS, {"key": claims.CLAIM_LOCK_KEY})
    return company


def resume_company(
    conn: psycopg.Connection[Any], company_id: uuid.UUID, *, notify_channel: str | None = None
) -> CompanyRecord:
    """Let the claim take the company's tasks again; return the company (`paused` false).

    Idempotent. Its runnable tasks are claimed in their usual order ("eligible since"), the
    company joining the ring at its end like any company whose work came due, with no credit
    kept from before the pause: the claim's promotion finds it through `due_at`, which the
    triggers kept a lower bound of its earliest pending `run_after` while it was paused.
    `NOTIFY notify_channel` (payload: the company id) wakes idle workers when the caller
    commits, as a create does. Raises `errors.NotFound`.
    """
    company = _set_paused(conn, company_id, False)
    if notify_channel:
        with driver_errors("resume_company"):
            conn.execute(
                "SELECT pg_notify(%(channel)s, %(company_id)s)",
                {"channel": notify_channel, "company_id": str(company_id)},
            )
    return company


def _require_transaction(conn: psycopg.Connection[Any], what: str) -> None:
    if conn.autocommit and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
        # Each statement would commit on its own: the locks would end before the commit
        # they must cover.
        raise RuntimeError(f"{what} needs a transaction; the connection is in autocommit")
