"""Company (tenant) statements. Callers own the session and commit."""

from __future__ import annotations

import enum
import uuid
from typing import Any

from sqlalchemy import insert, update
from sqlalchemy.orm import Session

from db import errors
from db.models import Company


class Unset(enum.Enum):
    """Marks a keyword argument the caller did not give (None is a value: "unlimited")."""

    UNSET = enum.auto()


UNSET = Unset.UNSET


def create_company(
    session: Session,
    *,
    name: str,
    api_key_hash: str,
    weight: int = 1,
    max_in_flight: int | None = None,
    max_pending: int | None = None,
) -> Company:
    """Insert a company; `api_key_hash` is the SHA-256 hex digest of its key.

    `weight`, `max_in_flight` and `max_pending` (None: unlimited) default to the columns'
    defaults.
    """
    stmt = (
        insert(Company)
        .values(
            name=name,
            api_key_hash=api_key_hash,
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


_COMPANY_ID_BY_KEY_HASH = "SELECT id FROM companies WHERE api_key_hash = %(hash)s"


def find_company_id_by_key_hash(session: Session, api_key_hash: str) -> uuid.UUID | None:
    """The id of the company whose API key hashes to `api_key_hash`, or None.

    Authentication's lookup: one indexed read (the unique constraint on `api_key_hash`),
    sent as plain SQL with no ORM object built.
    """
    result = session.connection().exec_driver_sql(_COMPANY_ID_BY_KEY_HASH, {"hash": api_key_hash})
    found = result.scalar_one_or_none()
    assert found is None or isinstance(found, uuid.UUID)  # psycopg loads uuid as UUID
    return found
