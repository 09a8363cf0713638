"""Company (tenant) statements. Callers own the session and commit."""

from __future__ import annotations

import uuid

from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from db import errors
from db.models import Company


def create_company(session: Session, *, name: str, api_key_hash: str) -> Company:
    """Insert a company; `api_key_hash` is the SHA-256 hex digest of its key."""
    stmt = insert(Company).values(name=name, api_key_hash=api_key_hash).returning(Company)
    return session.scalars(stmt).one()


def get_company(session: Session, company_id: uuid.UUID) -> Company:
    """The company with this id. Raises `errors.NotFound`."""
    company = session.get(Company, company_id)
    if company is None:
        raise errors.NotFound("company not found")
    return company


def find_company_by_key_hash(session: Session, api_key_hash: str) -> Company | None:
    """The company whose API key hashes to `api_key_hash`, or None."""
    return session.scalars(select(Company).where(Company.api_key_hash == api_key_hash)).first()
