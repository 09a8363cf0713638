"""Shared fixtures: a real PostgreSQL, migrated by Alembic, isolated per test.

- `db_session`: a session inside an outer transaction rolled back after the test; commits in
  the code under test become savepoint releases (SQLAlchemy "Joining a Session into an
  External Transaction").
- `client`: the Flask test client whose sessions join that same transaction.
- `fresh_db_url`: a new database copied from the migrated template, for tests whose threads
  or processes must see each other's commits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import Connection, Engine, pool
from sqlalchemy.orm import Session, sessionmaker

from api import create_app
from api.settings import ApiSettings
from db.engine import make_engine
from tests import pg

pytest_plugins = ["tests.factories"]

ADMIN_TOKEN = "test-admin-token-0123456789"


@pytest.fixture(scope="session")
def server() -> Iterator[pg.TestServer]:
    """The PostgreSQL server of this test session."""
    with pg.test_server() as srv:
        srv.build_template()
        yield srv
        srv.drop(pg.TEMPLATE_DB)


@pytest.fixture(scope="session")
def main_db_url(server: pg.TestServer) -> Iterator[str]:
    """One migrated database shared by all transaction-isolated tests."""
    name = server.create_from_template("fairq_test_main")
    yield server.url(name)
    server.drop(name)


@pytest.fixture(scope="session")
def engine(main_db_url: str) -> Iterator[Engine]:
    """Engine on the shared database."""
    eng = make_engine(main_db_url, application_name="fairq-tests")
    yield eng
    eng.dispose()


@pytest.fixture
def connection(engine: Engine) -> Iterator[Connection]:
    """A connection holding the outer transaction that is rolled back after the test."""
    with engine.connect() as conn:
        outer = conn.begin()
        yield conn
        outer.rollback()


@pytest.fixture
def session_factory(connection: Connection) -> sessionmaker[Session]:
    """Sessions that join the test's outer transaction through savepoints."""
    return sessionmaker(
        bind=connection, join_transaction_mode="create_savepoint", expire_on_commit=False
    )


@pytest.fixture
def db_session(session_factory: sessionmaker[Session]) -> Iterator[Session]:
    """A session whose commits vanish with the test's transaction."""
    with session_factory() as session:
        yield session


def make_test_app(database_url: str, **overrides: object) -> Flask:
    """An app on `database_url` with the test admin token, settings overridable."""
    values: dict[str, object] = {"admin_token": ADMIN_TOKEN, **overrides}
    settings = ApiSettings(database_url=database_url, **values)  # type: ignore[arg-type]
    app = create_app(settings)
    app.config["TESTING"] = True
    return app


@pytest.fixture(scope="session")
def shared_app(main_db_url: str) -> Iterator[Flask]:
    """One app for the session: building the OpenAPI spec per test would dominate run time."""
    app = make_test_app(main_db_url)
    yield app
    from api import database

    with app.app_context():
        database.engine().dispose()


@pytest.fixture
def app(shared_app: Flask, session_factory: sessionmaker[Session]) -> Iterator[Flask]:
    """The shared app, its request sessions joined to the test's outer transaction."""
    from api import database

    key = database._EXT
    engine_, original = shared_app.extensions[key]
    shared_app.extensions[key] = (engine_, session_factory)
    yield shared_app
    shared_app.extensions[key] = (engine_, original)


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    """Test client of `app`."""
    return app.test_client()


@pytest.fixture
def fresh_db_url(server: pg.TestServer) -> Iterator[str]:
    """URL of a new database copied from the migrated template, dropped after the test."""
    name = server.create_from_template()
    yield server.url(name)
    server.drop(name)


@pytest.fixture
def fresh_engine(fresh_db_url: str) -> Iterator[Engine]:
    """Engine on `fresh_db_url` (NullPool: no connection outlives its use)."""
    eng = make_engine(fresh_db_url, application_name="fairq-tests", poolclass=pool.NullPool)
    yield eng
    eng.dispose()


@pytest.fixture
def admin_headers() -> dict[str, str]:
    """Authorization header carrying the admin token."""
    return {"Authorization": f"Bearer {ADMIN_TOKEN}"}


AuthHeaders = Callable[[str], dict[str, str]]


@pytest.fixture
def bearer() -> AuthHeaders:
    """`bearer(key)` -> an Authorization header for that key."""
    return lambda key: {"Authorization": f"Bearer {key}"}
