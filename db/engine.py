"""SQLAlchemy engines and sessions (tests, scripts, devtools; Alembic has its own), and the
one translation of driver errors (`driver_errors`, `is_transient`).

Runtime statements go through `db.connector`'s psycopg connections (decision 0008); this is
the only place that calls `create_engine`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import psycopg
from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.exc import DBAPIError, DisconnectionError, InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from db.connector import TCP_ARGS


def make_engine(
    url: str,
    *,
    application_name: str = "fairq",
    statement_timeout_ms: int | None = None,
    transaction_pooling: bool = False,
    ping_after_idle: float | None = None,
    **kwargs: Any,
) -> Engine:
    """Build an engine for a `postgresql+psycopg://` URL.

    `pool_pre_ping` lets a process survive a database restart: a dead pooled connection is
    replaced instead of failing the next request. `hide_parameters`: an error's text (and so
    a logged traceback) never shows bound values, which include task payloads. Every
    connection gets `TCP_ARGS`. `statement_timeout_ms` (workers only: migrations and the
    API's views may legitimately run long) makes the server cancel any statement, lock waits
    included, after that long. Extra keyword arguments go to `create_engine` (tests pass
    `poolclass`).

    `transaction_pooling`: `url` is a transaction pooler (PgBouncer's `pool_mode =
    transaction`), which hands each transaction whichever server connection is free. Then no
    statement is prepared by name (psycopg's `prepare_threshold`: a name prepared on one server
    connection is unknown, or already taken, on the next) and no startup `options` are sent
    (PgBouncer refuses them), so `statement_timeout_ms` is not applied: set
    `statement_timeout` on the database role or PgBouncer's `query_timeout` instead.

    `ping_after_idle` (seconds; the API and worker children): instead of `pool_pre_ping`'s
    round trip on every checkout, ping only a connection that sat in the pool longer than
    that. A busy connection is not pinged; after a restart or an outage the pooled
    connections have been idle, so they are pinged and replaced. One used within that window
    before a restart fails its first statement (a 503 in the API, a retried pass in a worker
    child), and SQLAlchemy then invalidates the pool.
    """
    connect_args = kwargs.pop("connect_args", {})
    connect_args.setdefault("application_name", application_name)
    connect_args.setdefault("connect_timeout", 5)
    for name, value in TCP_ARGS.items():
        connect_args.setdefault(name, value)
    if transaction_pooling:
        connect_args["prepare_threshold"] = None
    elif statement_timeout_ms is not None:
        timeout = f"-c statement_timeout={int(statement_timeout_ms)}"
        given = connect_args.get("options")
        connect_args["options"] = f"{given} {timeout}" if given else timeout
    kwargs.setdefault("hide_parameters", True)
    engine = create_engine(
        url, pool_pre_ping=ping_after_idle is None, connect_args=connect_args, **kwargs
    )
    if ping_after_idle is not None:
        _ping_after_idle(engine, ping_after_idle)
    return engine


_IDLE_SINCE = "fairq_idle_since"


def _ping_after_idle(engine: Engine, seconds: float) -> None:
    @event.listens_for(engine, "checkin")
    def _checked_in(dbapi_connection: Any, record: Any) -> None:
        record.info[_IDLE_SINCE] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checked_out(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        idle_since = record.info.pop(_IDLE_SINCE, None)
        if idle_since is None or time.monotonic() - idle_since <= seconds:
            return
        try:
            # The dialect's ping: `SELECT 1` in autocommit, leaving no transaction open.
            engine.dialect.do_ping(dbapi_connection)
        except engine.dialect.loaded_dbapi.Error as exc:
            # The pool discards this connection and checks out another (a new one if need be).
            raise DisconnectionError(f"idle connection failed its ping: {exc}") from exc


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    """Session factory whose objects stay readable after commit (views serialize them)."""
    return sessionmaker(bind=engine, expire_on_commit=False)


def is_transient(exc: BaseException) -> bool:
    """Tell whether a database error is one to wait out (connection lost, server down).

    Anything else (a bug, a missing column) should propagate, so that it shows up as a crash
    and a restart rather than as a quiet retry loop. A statement cancelled by
    `statement_timeout` is an `OperationalError` too: transient.
    """
    if isinstance(exc, OperationalError | InterfaceError | psycopg.OperationalError):
        return True
    return isinstance(exc, DBAPIError) and exc.connection_invalidated


# What holds a psycopg connection: a session (its connection, in its transaction), a
# SQLAlchemy connection, or the psycopg connection itself.
Executor = Session | Connection | psycopg.Connection[Any]


def driver_connection(where: Executor, *, transaction: bool = True) -> psycopg.Connection[Any]:
    """The psycopg connection of `where`, for the `db` functions, which take one.

    For code that holds SQLAlchemy sessions or connections (tests, scripts, migrations'
    checks): every runtime statement goes through psycopg (decision 0008). `transaction`:
    refuse a connection in autocommit (raises `RuntimeError`).
    """
    driver: object = where
    if isinstance(where, Session):
        driver = where.connection().connection.driver_connection
    elif isinstance(where, Connection):
        driver = where.connection.driver_connection
    assert isinstance(driver, psycopg.Connection)
    if transaction and driver.autocommit:
        # Each statement would be a transaction of its own: a lock or a pinned plan would
        # end with the first one.
        raise RuntimeError("this needs a transaction; the connection is in autocommit")
    return driver


@contextlib.contextmanager
def driver_errors(what: str) -> Iterator[None]:
    """Raise a psycopg error of a statement sent to the driver as SQLAlchemy would.

    Callers handle database errors as `sqlalchemy.exc.DBAPIError` (the child's retry, the
    `--once` and API error handlers); statements sent to psycopg directly would escape them.
    `what` names the statement in the error's text, in place of its SQL.
    """
    try:
        yield
    except psycopg.Error as exc:
        raise DBAPIError.instance(what, None, exc, psycopg.Error) from exc
