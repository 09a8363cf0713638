"""The API's hot path (design §3 "Connections"): round trips, the key cache, the idle ping."""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from flask import Flask
from flask.testing import FlaskClient
from psycopg_pool import ConnectionPool
from sqlalchemy import text
from sqlalchemy.orm import Session

from api import auth, database
from api.settings import ApiSettings
from db import connector, queue
from db.engine import driver_connection, make_engine
from db.models import Task
from tests.conftest import Clock, make_test_app
from tests.factories import CompanyWithKey, add_key, insert_company

NOTIFY_CHANNEL = "fairq_tasks"


@pytest.fixture
def clock(app: Flask, monkeypatch: pytest.MonkeyPatch) -> Iterator[Clock]:
    """The shared app's key cache on a hand-moved clock, emptied before and after the test."""
    cache = auth.key_cache(app)
    fake = Clock()
    monkeypatch.setattr(cache, "clock", fake)
    cache.clear()
    yield fake
    cache.clear()


@pytest.fixture
def own_app(fresh_db_url: str) -> Iterator[Flask]:
    """An app on its own database with its own pool: statements commit as in production."""
    app = make_test_app(fresh_db_url)
    yield app
    database.close(app)


def pool_of(app: Flask) -> ConnectionPool[psycopg.Connection[Any]]:
    """The pool of `app`'s request connections."""
    source = database.source_of(app)
    assert isinstance(source, database.Pooled)
    return source.pool


class Counted:
    """`app`'s request connections, counted: how many were out at each checkout."""

    def __init__(self, inner: database.ConnectionSource, on_checkout: Any = None) -> None:
        self.inner = inner
        self.out = 0
        self.held: list[int] = []
        self.on_checkout = on_checkout

    def checkout(self) -> psycopg.Connection[Any]:
        """The inner source's connection."""
        conn = self.inner.checkout()
        self.out += 1
        self.held.append(self.out)
        if self.on_checkout is not None:
            self.on_checkout(conn)
        return conn

    def checkin(self, conn: psycopg.Connection[Any]) -> None:
        """Back to the inner source."""
        self.out -= 1
        self.inner.checkin(conn)

    def close(self) -> None:
        """Close the inner source."""
        self.inner.close()


class Statements:
    """What the app's connections sent, read from libpq's protocol trace: one entry per round
    trip (up to the server's ReadyForQuery), its first statement's text and whether the
    server was outside a transaction after it (autocommit: no BEGIN before, no COMMIT after).

    The trace is the wire itself, so statements sent to psycopg directly and SQLAlchemy's
    alike are seen, and so are pings. Every connection the pool hands out is traced.
    """

    def __init__(self, trace_path: Path) -> None:
        self.pings = 0
        self._path = trace_path
        self._file = trace_path.open("w")
        self._start = 0
        self._traced: list[psycopg.pq.abc.PGconn] = []

    def trace(self, conn: psycopg.Connection[Any]) -> None:
        """Trace `conn` from now on (once)."""
        if not any(pgconn is conn.pgconn for pgconn in self._traced):
            self._traced.append(conn.pgconn)
            self._start_trace(conn.pgconn)

    def _start_trace(self, pgconn: psycopg.pq.abc.PGconn) -> None:
        pgconn.trace(self._file.fileno())
        pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)

    def _flush(self) -> str:
        # libpq writes through a buffered stream of its own, flushed when tracing stops.
        for pgconn in self._traced:
            pgconn.untrace()
            self._start_trace(pgconn)
        return self._path.read_text()

    @property
    def sent(self) -> list[tuple[str, bool]]:
        """`(first statement, autocommit)` per round trip since the last `clear()`."""
        trips: list[tuple[str, bool]] = []
        texts: list[str] = []
        for message in self._messages():
            direction, kind, body = message
            if direction == "F" and kind in ("Query", "Parse"):
                # Query "sql" / Parse "name" "sql" ...: the statement is the last quoted text.
                texts.append(body.split('"')[-2] if kind == "Parse" else body.strip()[1:-1])
            elif direction == "B" and kind == "ReadyForQuery":
                first = " ".join(texts[0].split())[:60] if texts else ""
                trips.append((first, body.strip() == "I"))
                texts.clear()
        return trips

    def _messages(self) -> list[tuple[str, str, str]]:
        text = self._flush()[self._start :]
        messages: list[tuple[str, str, str]] = []
        for line in text.splitlines():
            fields = line.split("\t", 3)
            if len(fields) >= 3 and fields[0] in ("F", "B"):
                messages.append((fields[0], fields[2], fields[3] if len(fields) > 3 else ""))
            elif messages:  # a statement's text goes on over several lines
                direction, kind, body = messages[-1]
                messages[-1] = (direction, kind, f"{body}\n{line}")
        return messages

    def close(self) -> None:
        """Stop tracing and close the trace."""
        for pgconn in self._traced:
            pgconn.untrace()
        self._file.close()

    def clear(self) -> None:
        """Forget what was sent so far."""
        self._start = len(self._flush())
        self.pings = 0


@pytest.fixture
def statements(
    own_app: Flask, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[Statements]:
    """Round trips of `own_app`'s request connections, and their pings, from now on."""
    seen = Statements(tmp_path / "libpq-trace.txt")
    ping = ConnectionPool.check_connection

    def counted(conn: psycopg.Connection[Any]) -> None:
        seen.pings += 1
        ping(conn)

    monkeypatch.setattr(ConnectionPool, "check_connection", staticmethod(counted))
    before = database.install(own_app, Counted(database.source_of(own_app), seen.trace))
    yield seen
    database.install(own_app, before)
    seen.close()


def _own_company(app: Flask) -> CompanyWithKey:
    engine = make_engine(app.config["FAIRQ_SETTINGS"].database_url, application_name="fairq-tests")
    try:
        return insert_company(engine)
    finally:
        engine.dispose()


def test_a_create_is_one_statement_in_autocommit_with_no_ping(
    own_app: Flask, statements: Statements
) -> None:
    company = _own_company(own_app)
    client = own_app.test_client()
    url = f"/companies/{company.id}/tasks"
    assert client.post(url, json={"type": "noop"}, headers=company.headers).status_code == 201
    statements.clear()

    response = client.post(url, json={"type": "noop"}, headers=company.headers)

    assert response.status_code == 201
    # One statement, its own transaction (no BEGIN before it, no COMMIT after): the insert
    # and the NOTIFY together; the key was found by the cache, the connection was not pinged.
    assert [autocommit for _, autocommit in statements.sent] == [True]
    assert "INSERT INTO tasks" in statements.sent[0][0]
    assert statements.pings == 0


def test_a_read_and_a_list_are_one_statement_each(own_app: Flask, statements: Statements) -> None:
    company = _own_company(own_app)
    client = own_app.test_client()
    url = f"/companies/{company.id}/tasks"
    task_id = client.post(url, json={"type": "noop"}, headers=company.headers).json["id"]  # type: ignore[index]
    statements.clear()

    assert client.get(f"{url}/{task_id}", headers=company.headers).status_code == 200
    assert client.get(url, headers=company.headers).status_code == 200

    assert [autocommit for _, autocommit in statements.sent] == [True, True]
    assert statements.pings == 0


def test_a_created_task_wakes_listeners_once_committed(own_app: Flask, fresh_db_url: str) -> None:
    company = _own_company(own_app)
    dsn = fresh_db_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
        response = own_app.test_client().post(
            f"/companies/{company.id}/tasks",
            json={"type": "noop"},
            headers={**company.headers, "Idempotency-Key": "wake-1"},
        )
        assert response.status_code == 201
        first = [n.payload for n in listener.notifies(timeout=2, stop_after=1)]
        replay = own_app.test_client().post(
            f"/companies/{company.id}/tasks",
            json={"type": "noop"},
            headers={**company.headers, "Idempotency-Key": "wake-1"},
        )
        assert replay.status_code == 200
        again = [n.payload for n in listener.notifies(timeout=0.5)]
    assert first == [str(company.id)]
    assert again == []  # a replay inserts nothing and wakes nobody


def test_a_pooled_connection_killed_while_idle_is_replaced_before_use(fresh_db_url: str) -> None:
    pool = connector.make_pool(fresh_db_url, application_name="fairq-tests", min_size=1, max_size=1)
    try:
        conn = connector.checkout(pool, ping_after_idle=0.0)
        pid = conn.info.backend_pid
        connector.checkin(pool, conn)
        # Terminate the pooled connection's server process, as a restart would.
        with connector.connect(fresh_db_url, application_name="fairq-tests") as killer:
            killer.execute("SELECT pg_terminate_backend(%(pid)s)", {"pid": pid})

        conn = connector.checkout(pool, ping_after_idle=0.0)
        try:
            assert conn.execute("SELECT pg_backend_pid()").fetchone() != (pid,)
        finally:
            connector.checkin(pool, conn)
    finally:
        pool.close()


def test_a_connection_lost_mid_request_fails_that_request_and_no_other(
    own_app: Flask, fresh_db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    company = _own_company(own_app)
    # No ping before use, as for a connection used just now (however slow this box runs):
    # every pooled connection's server process dies together, as in a restart between two
    # requests, and the first request finds out by using its connection.
    monkeypatch.setattr(connector, "PING_AFTER_IDLE_SECONDS", math.inf)
    pool = pool_of(own_app)
    pool.open(wait=True)  # all of its connections made, none still to come
    with connector.connect(fresh_db_url, application_name="fairq-tests") as killer:
        killed = killer.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND application_name = 'fairq-api'"
        ).fetchall()
    assert killed == [(True,)] * pool.min_size

    client = own_app.test_client()
    url = f"/companies/{company.id}/tasks"
    lost = client.post(url, json={"type": "noop"}, headers=company.headers)
    # Two requests at once (one held here): the second takes the pool's next connection.
    held = connector.checkout(pool)
    try:
        concurrent = client.post(url, json={"type": "noop"}, headers=company.headers)
    finally:
        connector.checkin(pool, held)

    assert (lost.status_code, lost.headers["Retry-After"]) == (503, "1")
    # The pool dropped its other dead connections with the first: no second 503.
    assert concurrent.status_code == 201, concurrent.json


def test_a_request_holds_one_pooled_connection_at_a_time(own_app: Flask) -> None:
    company = _own_company(own_app)
    counted = Counted(database.source_of(own_app))
    database.install(own_app, counted)
    held = counted.held  # connections checked out, at each checkout
    client = own_app.test_client()
    url = f"/companies/{company.id}"
    requests_ = [
        ("POST", f"{url}/task-batches", {"tasks": [{"type": "noop"}]}),
        ("POST", f"{url}/pause", None),
        ("POST", f"{url}/resume", None),
        ("GET", f"{url}/stats", None),
        ("POST", f"{url}/tasks", {"type": "noop"}),
    ]
    for method, path, body in requests_:
        # Unknown to the key cache: authentication reads the key, then the view its work.
        auth.key_cache(own_app).clear()
        response = client.open(path, method=method, json=body, headers=company.headers)
        assert response.status_code in (200, 201), (path, response.json)

    assert held
    assert max(held) == 1, held


def test_a_busy_connection_is_not_pinged(
    fresh_db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = connector.make_pool(fresh_db_url, application_name="fairq-tests", min_size=1, max_size=1)
    pings: list[object] = []
    monkeypatch.setattr(ConnectionPool, "check_connection", staticmethod(pings.append))
    try:
        for _ in range(3):
            conn = connector.checkout(pool, ping_after_idle=60.0)
            conn.execute("SELECT 1")
            connector.checkin(pool, conn)
        assert pings == []
    finally:
        pool.close()


def test_a_known_key_is_looked_up_once_within_the_cache_window(
    app: Flask, client: FlaskClient, company: CompanyWithKey, clock: Clock
) -> None:
    url = f"/companies/{company.id}/tasks"
    assert client.get(url, headers=company.headers).status_code == 200
    assert auth.key_cache(app).get(auth.hash_api_key(company.api_key)) == company.id


def test_a_deleted_company_key_stops_working_after_the_cache_window(
    client: FlaskClient, db_session: Session, company: CompanyWithKey, clock: Clock
) -> None:
    url = f"/companies/{company.id}/tasks"
    assert client.get(url, headers=company.headers).status_code == 200
    db_session.execute(text("DELETE FROM companies WHERE id = :id"), {"id": company.id})

    # Within the window the key still authenticates, and the company's data is gone: a
    # write is refused as for a company that does not exist (never a 5xx).
    clock.now += auth.KEY_CACHE_SECONDS - 0.5
    assert client.get(url, headers=company.headers).json["items"] == []  # type: ignore[index]
    created = client.post(url, json={"type": "noop"}, headers=company.headers)
    assert created.status_code == 404, created.json

    clock.now += 1.0
    refused = client.get(url, headers=company.headers)
    assert refused.status_code == 401
    assert refused.headers["WWW-Authenticate"].startswith("Bearer")


def test_a_key_revoked_elsewhere_stops_working_after_the_cache_window(
    client: FlaskClient, db_session: Session, company: CompanyWithKey, clock: Clock
) -> None:
    """Revoked by another API process (here: in the database): this one, which remembered
    the key, refuses it once `KEY_CACHE_SECONDS` have passed, not before."""
    url = f"/companies/{company.id}/tasks"
    assert client.get(url, headers=company.headers).status_code == 200
    new_key = auth.new_api_key()
    db_session.execute(
        text("UPDATE api_keys SET revoked_at = now() WHERE company_id = :id"),
        {"id": company.id},
    )
    add_key(db_session, company.id, new_key)
    clock.now += auth.KEY_CACHE_SECONDS - 0.5
    assert client.get(url, headers=company.headers).status_code == 200
    clock.now += 0.6

    assert client.get(url, headers=company.headers).status_code == 401
    new_headers = {"Authorization": f"Bearer {new_key}"}
    assert client.get(url, headers=new_headers).status_code == 200


def test_an_unknown_key_is_never_remembered(app: Flask, client: FlaskClient, clock: Clock) -> None:
    url = f"/companies/{uuid.uuid4()}/tasks"
    for _ in range(2):
        response = client.get(url, headers={"Authorization": "Bearer fq_not-a-key"})
        assert response.status_code == 401
    assert auth.key_cache(app).get(auth.hash_api_key("fq_not-a-key")) is None


def test_the_key_cache_forgets_entries_after_its_ttl_and_stays_bounded() -> None:
    clock = Clock()
    cache = auth.KeyCache(ttl=5.0, size=2, clock=clock)
    first, second, third = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    cache.put("a", first)
    clock.now += 4.9
    assert cache.get("a") == first
    clock.now += 0.1
    assert cache.get("a") is None

    cache.put("a", first)
    cache.put("b", second)
    cache.put("c", third)  # over the bound: starts over
    assert (cache.get("a"), cache.get("b"), cache.get("c")) == (None, None, third)


def test_a_task_record_carries_the_stored_values(
    db_session: Session, company: CompanyWithKey
) -> None:
    record, created = queue.create_task(
        driver_connection(db_session, transaction=False),
        company_id=company.id, type="noop", payload={"n": 1}, idempotency_key="k",
        request_hash="h", notify_channel=NOTIFY_CHANNEL,
    )  # fmt: skip
    stored = db_session.get(Task, record.id)

    assert created
    assert stored is not None
    assert record == queue.get_task(
        driver_connection(db_session, transaction=False), company.id, record.id
    )
    assert {name: getattr(stored, name) for name in queue.TaskRecord._fields} == record._asdict()


def test_the_pool_keeps_one_connection_per_gunicorn_thread(main_db_url: str) -> None:
    settings = ApiSettings.from_env({"DATABASE_URL": main_db_url, "GUNICORN_THREADS": "8"})
    app = make_test_app(main_db_url, database_pool_size=settings.database_pool_size)
    try:
        pool = pool_of(app)
        assert (pool.min_size, pool.max_size) == (8, 16)
    finally:
        database.close(app)
