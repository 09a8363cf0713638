"""Test data: plain builders (`insert_*`) and fixtures on top of them; loaded by conftest.

Layered: `make_company` -> `company` and `make_task` (a row, any state) -> `created_task`
(through the API), all on the test's rolled-back session; `fresh_company_id` on the fresh
database that threads and processes see. `insert_company` and `insert_tasks` write to any
`Target`, so process tests share them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from flask.testing import FlaskClient
from sqlalchemy import Engine, func, insert, select, text
from sqlalchemy.orm import Session, sessionmaker
from werkzeug.test import TestResponse

from api import auth
from db import api_keys, companies, workers
from db.engine import driver_connection
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

# Where a builder writes: the test's session (commits through it), or an engine or sessionmaker
# to open a session of its own on (for tests whose threads or processes must see the rows).
Target = Session | Engine | sessionmaker[Session]


@contextmanager
def session_of(db: Target) -> Iterator[Session]:
    """`db` itself when it is a session, else a session opened on it and closed afterwards."""
    if isinstance(db, Session):
        yield db
        return
    with Session(db) if isinstance(db, Engine) else db() as session:
        yield session


def add_key(session: Session, company_id: uuid.UUID, key: str) -> None:
    """Store `key` as an API key of the company (not committed)."""
    api_keys.issue_key(
        driver_connection(session, transaction=False), company_id, auth.hash_api_key(key)
    )


def insert_company(db: Target, name: str = "acme") -> CompanyWithKey:
    """Store a company with a fresh key, then commit."""
    key = auth.new_api_key()
    with session_of(db) as session:
        company = companies.create_company(driver_connection(session, transaction=False), name=name)
        add_key(session, company.id, key)
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
def company(make_company: MakeCompany) -> CompanyWithKey:
    """The company a test works with (its requests, its tasks), on the test's session."""
    return make_company()


@pytest.fixture
def fresh_company_id(fresh_engine: Engine) -> uuid.UUID:
    """The id of a company stored in the fresh database (`fresh_engine`), for process tests."""
    return insert_company(fresh_engine).id


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
        type: str = "noop",
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


def json_of(response: TestResponse) -> dict[str, Any]:
    """The JSON object of a response; fails the test when the body is not a JSON object."""
    data = response.get_json(silent=True)
    assert isinstance(data, dict), (response.status_code, response.get_data(as_text=True)[:300])
    return data


def company_limits(session: Session, company_id: uuid.UUID) -> tuple[int, int | None]:
    """`(weight, max_in_flight)` as stored for `company_id`, read past the session's cache."""
    row = session.execute(
        text("SELECT weight, max_in_flight FROM companies WHERE id = :id"), {"id": company_id}
    ).one()
    return row.weight, row.max_in_flight


def count_tasks(session: Session, company_id: uuid.UUID) -> int:
    """How many task rows `company_id` has (what a failed request must leave unchanged)."""
    stmt = select(func.count()).select_from(Task).where(Task.company_id == company_id)
    return session.execute(stmt).scalar_one()


@pytest.fixture
def claimed_task(db_session: Session) -> MakeTask:
    """`claimed_task(company_id, **columns)` -> a stored task held under a fresh lease.

    As a claim leaves it: `processing`, attempt 1, `locked_at` and `started_at` now, a new
    `lease_token` (read it from the returned row), `locked_by` "test:1".
    """

    def make(company_id: uuid.UUID, **values: Any) -> Task:
        row: dict[str, Any] = {
            "status": "processing",
            "attempts": 1,
            "lease_token": uuid.uuid4(),
            "locked_by": "test:1",
            "locked_at": text("now()"),
            "started_at": text("now()"),
            **values,
        }
        return insert_task(db_session, company_id, **row)

    return make


def insert_tasks(
    db: Target,
    company_id: uuid.UUID,
    count: int = 1,
    *,
    task_type: str = "noop",
    payload: dict[str, Any] | None = None,
    newest_age_seconds: float = 0.0,
    max_attempts: int = 5,
    notify_channel: str | None = None,
) -> list[uuid.UUID]:
    """Insert `count` runnable pending tasks in one statement, then commit; ids oldest first.

    They are created one second apart, the newest `newest_age_seconds` ago (database clock),
    and, like every task created without `run_at` and never retried, were runnable from the
    moment they were created: `run_after = created_at`. So they are older eligible work in the
    claim's order too ("eligible since", `db.claims.claim`). With `notify_channel`, NOTIFY on it
    in the same transaction, as the API does.
    """
    with session_of(db) as session:
        rows = session.execute(
            text(
                """
                INSERT INTO tasks (company_id, type, payload, status, max_attempts, run_after,
                                   created_at, updated_at)
                SELECT :company_id, :type, CAST(:payload AS jsonb), 'pending', :max_attempts,
                       at, at, at
                FROM generate_series(1, :count) AS g,
                     LATERAL (SELECT now() - make_interval(secs => :age + (:count - g)) AS at) AS c
                RETURNING id, created_at
                """
            ),
            {
                "company_id": company_id,
                "type": task_type,
                "payload": json.dumps(payload or {}),
                "max_attempts": max_attempts,
                "age": float(newest_age_seconds),
                "count": count,
            },
        ).all()
        if notify_channel:
            session.execute(text("SELECT pg_notify(:channel, 'x')"), {"channel": notify_channel})
        session.commit()
        return [row.id for row in sorted(rows, key=lambda row: row.created_at)]


def insert_delayed_tasks(session: Session, company_id: uuid.UUID, count: int) -> None:
    """Insert `count` pending tasks created two days ago, runnable only tomorrow; commit.

    As a tenant's tasks scheduled with `run_at` for tomorrow, or all backed off because their
    webhook target is down. In created_at order they come before the company's runnable work.
    """
    session.execute(
        text(
            "INSERT INTO tasks (company_id, type, payload, run_after, created_at, updated_at) "
            "SELECT :company_id, 'noop', '{}', now() + interval '1 day' + g * interval '1 ms', "
            "now() - interval '2 days' + g * interval '1 ms', now() "
            "FROM generate_series(1, :count) AS g"
        ),
        {"company_id": company_id, "count": count},
    )
    session.commit()


def insert_weighted_company(
    session: Session, name: str = "acme", *, weight: int = 1, max_in_flight: int | None = None
) -> CompanyWithKey:
    """Store a company with this `weight` and `max_in_flight` (None: unlimited); commit."""
    key = auth.new_api_key()
    company = companies.create_company(
        driver_connection(session, transaction=False),
        name=name,
        weight=weight,
        max_in_flight=max_in_flight,
    )
    add_key(session, company.id, key)
    session.commit()
    return CompanyWithKey(company.id, company.name, key)


@pytest.fixture
def make_weighted_company(db_session: Session) -> MakeCompany:
    """`make_weighted_company(name="acme", weight=1, max_in_flight=None)` -> a stored company."""

    def make(
        name: str = "acme", *, weight: int = 1, max_in_flight: int | None = None
    ) -> CompanyWithKey:
        return insert_weighted_company(db_session, name, weight=weight, max_in_flight=max_in_flight)

    return make


def insert_companies_with_tasks(
    session: Session, count: int, tasks_each: int, prefix: str
) -> list[uuid.UUID]:
    """Store `count` companies with `tasks_each` runnable noop tasks each; commit; their ids.

    Two statements whatever the count, for tests about thousands of tenants.
    """
    ids: list[uuid.UUID] = list(
        session.execute(
            text(
                "INSERT INTO companies (name) SELECT :prefix || g "
                "FROM generate_series(1, :n) AS g RETURNING id"
            ),
            {"n": count, "prefix": prefix},
        ).scalars()
    )
    session.execute(
        text(
            "INSERT INTO tasks (company_id, type, payload) "
            "SELECT c, 'noop', '{}' FROM unnest(CAST(:ids AS uuid[])) AS c, "
            "generate_series(1, :per)"
        ),
        {"ids": ids, "per": tasks_each},
    )
    session.commit()
    return ids


def take_back(
    session: Session, *, stale_after: float, limit: int = 1000
) -> list[workers.TakenBack]:
    """The sweep as workers run it (`db.workers.take_back_leases`), on `session`'s connection.

    Not committed: the caller commits (or the test's transaction is rolled back).
    """
    conn = driver_connection(session, transaction=False)
    return workers.take_back_leases(conn, stale_after=stale_after, limit=limit)
