"""Shared fixtures: a real PostgreSQL, migrated by Alembic, isolated per test.

- `db_session`: a session inside an outer transaction rolled back after the test; commits in
  the code under test become savepoint releases (SQLAlchemy "Joining a Session into an
  External Transaction").
- `db_conn`: the psycopg connection of that same transaction, for `db` functions.
- `client`: the Flask test client whose requests run in that same transaction too: the
  app's request connection is wrapped (`JoinedSource`), each request in a savepoint.
- `fresh_db_url`: a new database copied from the migrated template, for tests whose threads
  or processes must see each other's commits.
- `supervisor`: starts `python -m worker` on that database (`tests/supervisor_harness.py`).

Test data (`make_company`, `company`, `insert_tasks`, ...) comes from `tests/factories.py`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import Connection, Engine, pool
from sqlalchemy.orm import Session, sessionmaker
from werkzeug.serving import make_server

from api import create_app, database
from api.settings import ApiSettings
from db.engine import make_engine
from tests import pg
from tests import supervisor_harness as harness
from tests.supervisor_harness import StartSupervisor

pytest_plugins = ["tests.factories"]

# Made as README says (`secrets.token_urlsafe(32)`): servers started from the environment
# refuse a guessable one.
ADMIN_TOKEN = "kyhS0w8VuBNakPQtPLyr-6EcgNQ9mgVmcdSqIu8xv_0"


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
def db_conn(connection: Connection) -> psycopg.Connection[Any]:
    """The psycopg connection holding the test's outer transaction (`connection`'s).

    `conn.transaction()` on it makes savepoints: what the code under test commits vanishes
    with the test's transaction.
    """
    # The transaction begins at the first statement: before a `conn.transaction()` would
    # take the connection for idle and commit.
    connection.exec_driver_sql("SELECT 1")
    driver = connection.connection.driver_connection
    assert isinstance(driver, psycopg.Connection)
    return driver


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


# An `auth_failure_limit` no test reaches.
UNTHROTTLED = 10**9


def make_test_app(database_url: str, **overrides: object) -> Flask:
    """An app on `database_url` with the test admin token, settings overridable.

    Failed authentications are not throttled (tests of 401s send many from one address),
    unless `auth_failure_limit` is given (tests/test_auth_throttle.py).
    """
    values: dict[str, object] = {
        "admin_token": ADMIN_TOKEN,
        "auth_failure_limit": UNTHROTTLED,
        **overrides,
    }
    settings = ApiSettings(database_url=database_url, **values)  # type: ignore[arg-type]
    app = create_app(settings)
    app.config["TESTING"] = True
    return app


@pytest.fixture(scope="session")
def shared_app(main_db_url: str) -> Iterator[Flask]:
    """One app for the session: building the OpenAPI spec per test would dominate run time."""
    app = make_test_app(main_db_url)
    yield app
    database.close(app)


class JoinedSource:
    """The request connection of an app under test: the test's own connection, each request
    in a savepoint of the test's transaction (rolled back to when a statement failed, as a
    statement in autocommit leaves nothing behind)."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn

    def checkout(self) -> psycopg.Connection[Any]:
        """The test's connection, in a new savepoint."""
        self.conn.execute("SAVEPOINT fairq_request")
        return self.conn

    def checkin(self, conn: psycopg.Connection[Any]) -> None:
        """End the request's savepoint."""
        if conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR:
            conn.execute("ROLLBACK TO SAVEPOINT fairq_request")
        conn.execute("RELEASE SAVEPOINT fairq_request")

    def close(self) -> None:
        """Nothing: the connection is the test's."""


@pytest.fixture
def app(shared_app: Flask, db_conn: psycopg.Connection[Any]) -> Iterator[Flask]:
    """The shared app, its requests joined to the test's outer transaction."""
    before = database.install(shared_app, JoinedSource(db_conn))
    yield shared_app
    database.install(shared_app, before)


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    """Test client of `app`."""
    return app.test_client()


@contextlib.contextmanager
def serve_app(database_url: str) -> Iterator[int]:
    """Run the app on `database_url` in a real threaded HTTP server; yield its port."""
    app = make_test_app(database_url)
    http = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=http.serve_forever, name="live-api", daemon=True)
    thread.start()
    try:
        yield http.server_port
    finally:
        http.shutdown()
        thread.join(timeout=10)
        http.server_close()
        database.close(app)


@pytest.fixture(scope="module")
def live_api_port(main_db_url: str) -> Iterator[int]:
    """Port of a real HTTP server on the shared database: for tests that only read from it."""
    with serve_app(main_db_url) as port:
        yield port


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
def supervisor(tmp_path: Path, fresh_db_url: str) -> Iterator[StartSupervisor]:
    """`supervisor(*flags, **env)` runs `python -m worker` on the fresh database.

    Every supervisor and child it started is killed at teardown if still alive.
    """
    yield from harness.supervisors(tmp_path, fresh_db_url)


@pytest.fixture
def admin_headers() -> dict[str, str]:
    """Authorization header carrying the admin token."""
    return {"Authorization": f"Bearer {ADMIN_TOKEN}"}


AuthHeaders = Callable[[str], dict[str, str]]


@pytest.fixture
def bearer() -> AuthHeaders:
    """`bearer(key)` -> an Authorization header for that key."""
    return lambda key: {"Authorization": f"Bearer {key}"}


# -- the order of the tests ------------------------------------------------------------------


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the tests marked `longest` first, the others in their order.

    Each test process of xdist starts on its own share of this list: a test of minutes (the
    compose test) at its head then runs beside the others instead of holding up the end.
    """
    items.sort(key=lambda item: item.get_closest_marker("longest") is None)


# -- reports at the end of the run ------------------------------------------------------------

# What tests record with `record_property("report", text)`, printed after the results (the
# compose test says which images were stand-ins, and how long each step took). Under xdist
# the reports reach the controlling process with each test's teardown report.
_REPORTS: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Keep the reports a test recorded, once it is torn down."""
    if report.when == "teardown":
        _REPORTS.extend(str(value) for name, value in report.user_properties if name == "report")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print the reports the tests recorded."""
    if _REPORTS:
        terminalreporter.section("reports")
        for text in _REPORTS:
            terminalreporter.write_line(text)


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now
