"""Per-request database sessions bound to the app's engine, and the readiness probe's engine."""

from __future__ import annotations

import math
from typing import Any

import psycopg
from flask import Flask, current_app, g
from sqlalchemy import Engine, PoolProxiedConnection, pool
from sqlalchemy.orm import Session, sessionmaker

from db.engine import driver_connection, driver_errors, make_engine, make_sessionmaker

_EXT = "fairq.database"
_PROBE_EXT = "fairq.database.probe"
_REQUEST_EXT = "fairq.database.request"
# A pooled connection idle longer than this is pinged before use (a restart is survived).
PING_AFTER_IDLE_SECONDS = 1.0
# libpq (and psycopg) take whole seconds and treat anything below 2 as 2.
MIN_CONNECT_TIMEOUT_SECONDS = 2
# The isolation of `session_factory()`'s transactions; the queue's statements are written
# for it (db/queue.py: a conflicting key's row is read by a second statement's snapshot).
TRANSACTION_ISOLATION = "READ COMMITTED"


def init_app(
    app: Flask, database_url: str, *, transaction_pooling: bool = False, pool_size: int = 4
) -> None:
    """Create the app's engines and close the request's session at teardown.

    The views' engine keeps `pool_size` connections (one per request thread: a request holds
    at most one at a time) plus as many again in overflow for bursts and `POST
    /workers/process`; it pings a connection only after `PING_AFTER_IDLE_SECONDS` in the pool
    (`db.engine.make_engine`), not on every checkout. Besides it, a probe engine for `/ready`:
    no pool (each probe opens a fresh connection, so it proves the server accepts
    connections, and never waits on a pooled socket to a hung server) and a connect timeout
    derived from the readiness timeout (`FAIRQ_SETTINGS.ready_timeout_ms`) instead of the
    views' 5 seconds.
    `transaction_pooling`: `database_url` is a transaction pooler (`db.engine.make_engine`).
    """
    engine = make_engine(
        database_url,
        application_name="fairq-api",
        transaction_pooling=transaction_pooling,
        ping_after_idle=PING_AFTER_IDLE_SECONDS,
        pool_size=pool_size,
        max_overflow=pool_size,
        # The most recently used connection first: under light load the surplus stays idle
        # (and is pinged once before its next use) instead of every connection going stale.
        pool_use_lifo=True,
        # The request session's statements each commit on their own (no BEGIN, COMMIT or
        # ROLLBACK round trips): every view's read or write is one statement (design §3).
        # The pool's connections stay in autocommit, so a request's checkout sets nothing:
        # switching a connection there and back at each request cost more than the checkout.
        isolation_level="AUTOCOMMIT",
    )
    # Work that must commit together: PostgreSQL's default level, set on each checkout.
    factory = make_sessionmaker(engine.execution_options(isolation_level=TRANSACTION_ISOLATION))
    app.extensions[_EXT] = (engine, factory)
    app.extensions[_REQUEST_EXT] = (factory, make_sessionmaker(engine))
    settings = app.config.get("FAIRQ_SETTINGS")
    timeout_ms = settings.ready_timeout_ms if settings is not None else 1000
    app.extensions[_PROBE_EXT] = make_engine(
        database_url,
        application_name="fairq-api-probe",
        transaction_pooling=transaction_pooling,
        poolclass=pool.NullPool,
        connect_args={
            "connect_timeout": max(MIN_CONNECT_TIMEOUT_SECONDS, math.ceil(timeout_ms / 1000))
        },
    )

    @app.teardown_appcontext
    def _close_session(_exc: BaseException | None) -> None:
        _release_connection()
        session: Session | None = g.pop("db_session", None)
        if session is not None:
            session.close()


def engine_of(app: Flask) -> Engine:
    """The pooled engine of `app`, in autocommit (views reach it through `session()`).

    Each statement on it commits by itself; a transaction takes a session of
    `session_factory()`, on the same pool.
    """
    pair: tuple[Engine, sessionmaker[Session]] = app.extensions[_EXT]
    return pair[0]


def probe_engine_of(app: Flask) -> Engine:
    """The readiness-probe engine of `app` (unpooled, short connect timeout)."""
    probe: Engine = app.extensions[_PROBE_EXT]
    return probe


def probe_engine() -> Engine:
    """The current app's readiness-probe engine."""
    return probe_engine_of(current_app)


def session() -> Session:
    """The request's session, created on first use, in autocommit: each statement commits.

    Every view's read or write is one statement, so that is the same guarantee as one commit
    at the end, without its round trips; `session.commit()` in a view is then a no-op. Work
    of several statements that must commit together takes a session of `session_factory()`.
    A session factory installed in place of the app's own (tests join sessions to an outer
    transaction) is used as it is.
    """
    current: Session | None = g.get("db_session")
    if current is None:
        # One pooled connection per request at a time: `connection()`'s goes back first.
        _release_connection()
        pair: tuple[Engine, sessionmaker[Session]] = current_app.extensions[_EXT]
        own, autocommit = current_app.extensions[_REQUEST_EXT]
        current = g.db_session = (autocommit if pair[1] is own else pair[1])()
    return current


def connection() -> psycopg.Connection[Any]:
    """The request's psycopg connection, in autocommit: each statement commits by itself.

    For work of one statement that needs no ORM (a task's create, read and list, the API
    key lookup), sent with `db.engine.driver_errors`: no session, no SQLAlchemy connection
    or result around it. Checked out of the app's pool on first use and returned at
    teardown, or when the request then opens `session()`; when the server dropped it
    meanwhile, it is discarded with the rest of the pool. Once the request has a session, or
    when a session factory is installed in place of the app's own (tests join sessions to an
    outer transaction), it is that session's connection.
    """
    raw: PoolProxiedConnection | None = g.get("db_connection")
    if raw is None:
        pair: tuple[Engine, sessionmaker[Session]] = current_app.extensions[_EXT]
        own, _autocommit = current_app.extensions[_REQUEST_EXT]
        if pair[1] is not own or "db_session" in g:
            return driver_connection(session(), transaction=False)
        # The pool raises the driver's own error when it cannot connect.
        with driver_errors("connect"):
            raw = g.db_connection = pair[0].raw_connection()
    driver = raw.driver_connection
    assert isinstance(driver, psycopg.Connection)
    return driver


def _release_connection() -> None:
    raw: PoolProxiedConnection | None = g.pop("db_connection", None)
    if raw is None:
        return
    driver = raw.driver_connection
    if isinstance(driver, psycopg.Connection) and driver.broken:
        # Lost mid-request (a restart, a dropped network): the pool replaces it, and the
        # pool's other connections too, as SQLAlchemy does on a disconnect: they were most
        # likely lost with it, and each would fail a request of its own.
        raw.invalidate()
        engine_of(current_app).dispose()
    else:
        raw.close()


def session_factory() -> sessionmaker[Session]:
    """The current app's session factory, for work that needs sessions of its own.

    A transaction of several statements (a batch, a pause, a statistics read) takes one; a
    processing pass (`POST /workers/process`) opens one per thread. Taking it gives back the
    request's own pooled connection first (`release`): authentication may have used it, and
    a request holds one at a time.
    """
    release()
    pair: tuple[Engine, sessionmaker[Session]] = current_app.extensions[_EXT]
    return pair[1]


def release() -> None:
    """Give back the request's pooled connection: `connection()`'s, or its session's.

    What the request wrote through them has committed by then: `connection()` is in
    autocommit, and the session's commit is called here. A view that writes through
    `connection()` calls this when done, so its writes also commit where `connection()` is
    a session's (a session factory installed in place of the app's own: tests). A later
    `connection()` or `session()` takes a connection again.
    """
    _release_connection()
    current: Session | None = g.get("db_session")
    if current is not None:
        current.commit()
