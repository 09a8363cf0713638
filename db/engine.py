"""SQLAlchemy engines and sessions (tests, scripts, devtools; Alembic has its own), and the
one translation of driver errors (`driver_errors`, `is_transient`).

Runtime statements go through `db.connector`'s psycopg connections (decision 0008); this is
the only place that calls `create_engine`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import psycopg
from sqlalchemy import Connection, Engine, create_engine
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from db.connector import TCP_ARGS


def make_engine(
    url: str,
    *,
    application_name: str = "fairq",
    statement_timeout_ms: int | None = None,
    transaction_pooling: bool = False,
    **kwargs: Any,
) -> Engine:
    """Build an engine for a `postgresql+psycopg://` URL (tests, scripts, devtools).

    With the runtime connections' settings (`db.connector.connect_kwargs`: `TCP_ARGS`, the
    connect timeout, `statement_timeout_ms`, `transaction_pooling`), so a script or test
    that stands for a worker behaves like one. `pool_pre_ping` replaces a dead pooled
    connection instead of failing the next use. `hide_parameters`: an error's text (and so
    a logged traceback) never shows bound values, which include task payloads. Extra keyword
    arguments go to `create_engine` (tests pass `poolclass`).
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
    return create_engine(url, pool_pre_ping=True, connect_args=connect_args, **kwargs)


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
