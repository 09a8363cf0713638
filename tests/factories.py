"""Test data builders: fixtures returning functions with overridable defaults.

Layered: `make_company` -> `make_task` (a row, any state) -> `created_task` (through the API).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from flask.testing import FlaskClient
from sqlalchemy import insert, text
from sqlalchemy.orm import Session

from api import auth
from db import companies
from db.models import Task


@dataclass(frozen=True)
class CompanyWithKey:
    """A stored company and its clear-text API key."""

    id: uuid.UUID
    name: str
    api_key: str

    @property
    def headers(self) -> dict[str, str]:
        """Authorization header for this company."""
        return {"Authorization": f"Bearer {self.api_key}"}


MakeCompany = Callable[..., CompanyWithKey]
MakeTask = Callable[..., Task]


def insert_company(session: Session, name: str = "acme") -> CompanyWithKey:
    """Store a company with a fresh key (commits through the caller's session)."""
    key = auth.new_api_key()
    company = companies.create_company(session, name=name, api_key_hash=auth.hash_api_key(key))
    session.commit()
    return CompanyWithKey(company.id, company.name, key)


def insert_task(session: Session, company_id: uuid.UUID, **values: Any) -> Task:
    """Insert one task row with defaults (`noop`, pending, runnable now), then commit.

    Timestamps may be given as SQL text, e.g. `created_at=text("now() - interval '1 h'")`.
    """
    row: dict[str, Any] = {
        "company_id": company_id,
        "type": "noop",
        "payload": {},
        "status": "pending",
        "run_after": text("now()"),
        **values,
    }
    task = session.scalars(insert(Task).values(**row).returning(Task)).one()
    session.commit()
    return task


@pytest.fixture
def make_company(db_session: Session) -> MakeCompany:
    """`make_company(name="acme")` -> a stored company with its API key."""
    return lambda name="acme": insert_company(db_session, name)


@pytest.fixture
def make_task(db_session: Session) -> MakeTask:
    """`make_task(company_id, **columns)` -> a stored task row."""
    return lambda company_id, **values: insert_task(db_session, company_id, **values)


CreatedTask = Callable[..., dict[str, Any]]


@pytest.fixture
def created_task(client: FlaskClient) -> CreatedTask:
    """`created_task(company, type="noop", payload={}, **body)` -> task JSON made via the API."""

    def create(
        company: CompanyWithKey,
        type: str = "noop",  # noqa: A002  (mirrors the API field)
        payload: dict[str, Any] | None = None,
        **body: Any,
    ) -> dict[str, Any]:
        response = client.post(
            f"/companies/{company.id}/tasks",
            json={"type": type, "payload": payload or {}, **body},
            headers=company.headers,
        )
        assert response.status_code == 201, response.json
        data: dict[str, Any] = response.json  # type: ignore[assignment]
        return data

    return create
