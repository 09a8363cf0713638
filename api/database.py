"""The request's database: one statement (`connection()`) or one transaction
(`transaction()`) on a connection of the app's pool, and the readiness probe's connection.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any, Protocol

import psycopg
from flask import Flask, current_app, g

from db import connector
from db.engine import driver_errors

_EXT = "fairq.database"
# libpq (and psycopg) take whole seconds and treat anything below 2 as 2.
MIN_CONNECT_TIMEOUT_SECONDS = 2


class ConnectionSource(Protocol):
    """Where the request's connection comes from: the app's pool (`Pooled`), or what a
    test installs in its place to join the request to its own transaction."""

    def checkout(self) -> psycopg.Connection[Any]:
        """A connection for this request, in autocommit or inside a transaction."""
        ...

    def checkin(self, conn: psycopg.Connection[Any]) -> None:
        """Give back what `checkout` gave."""
        ...

    def close(self) -> None:
        """Close every connection (the app is done)."""
        ...


class Pooled:
    """The app's pool (`db.connector.make_pool`); a connection idle a while is pinged first."""

    def __init__(self, url: str, *, transaction_pooling: bool, pool_size: int) -> None:
        self.pool = connector.make_pool(
            url,
            application_name="fairq-api",
            transaction_pooling=transaction_pooling,
            # One per request thread (a request holds at most one at a time; `POST
            # /workers/process` runs its pass on it), as many again at busy times.
            min_size=pool_size,
            max_size=2 * pool_size,
        )

    def checkout(self) -> psycopg.Connection[Any]:
        """A pooled connection in autocommit; raises a driver error when none comes."""
        return connector.checkout(self.pool)

    def checkin(self, conn: psycopg.Connection[Any]) -> None:
        """Back to the pool; a lost one makes the pool replace its idle connections."""
        connector.checkin(self.pool, conn)

    def close(self) -> None:
        """Close the pool and its connections."""
        self.pool.close()


def init_app(
    app: Flask,
    database_url: str,
    *,
    transaction_pooling: bool = False,
    pool_size: int = 4,
    ready_timeout_ms: int = 1000,
) -> None:
    """Open the app's pool and give the request's connection back at teardown.

    The pool keeps `pool_size` connections (one per request thread) and as many again at
    busy times (`Pooled`). Beside it, the readiness probe's connection (`probe()`): no pool
    (each probe opens a fresh connection, so it proves the server accepts connections, and
    never waits on a pooled socket to a hung server) and a connect timeout derived from the
    readiness timeout (`ready_timeout_ms`: `ApiSettings.ready_timeout_ms`) instead of the
    views' 5 seconds.
    `transaction_pooling`: `database_url` is a transaction pooler (`db.connector`).
    """
    app.extensions[_EXT] = Pooled(
        database_url, transaction_pooling=transaction_pooling, pool_size=pool_size
    )
    app.config["FAIRQ_PROBE"] = {
        "url": database_url,
        "application_name": "fairq-api-probe",
        "transaction_pooling": transaction_pooling,
        "connect_timeout": max(MIN_CONNECT_TIMEOUT_SECONDS, math.ceil(ready_timeout_ms / 1000)),
    }

    @app.teardown_appcontext
    def _give_back(_exc: BaseException | None) -> None:
        conn: psycopg.Connection[Any] | None = g.pop("db_connection", None)
        if conn is not None:
            source_of(app).checkin(conn)


def source_of(app: Flask) -> ConnectionSource:
    """Where `app`'s requests take their connection (`Pooled`, unless a test replaced it)."""
    source: ConnectionSource = app.extensions[_EXT]
    return source


def install(app: Flask, source: ConnectionSource) -> ConnectionSource:
    """Make `app`'s requests take their connection from `source`; return the one before."""
    before = source_of(app)
    app.extensions[_EXT] = source
    return before


def close(app: Flask) -> None:
    """Close `app`'s pool (at shutdown; tests that build apps of their own)."""
    source_of(app).close()


def connection() -> psycopg.Connection[Any]:
    """The request's connection, in autocommit: each statement commits by itself.

    For a view's work of one statement (every read and most writes, design §3): no BEGIN,
    COMMIT or ROLLBACK round trips. Checked out of the app's pool on first use and given
    back at teardown; raises the driver's error (a 503) when none can be had.
    """
    conn: psycopg.Connection[Any] | None = g.get("db_connection")
    if conn is None:
        # The pool raises its own timeout, or the driver's error, when it cannot connect.
        with driver_errors("connect"):
            conn = g.db_connection = source_of(current_app).checkout()
    return conn


@contextlib.contextmanager
def transaction() -> Iterator[psycopg.Connection[Any]]:
    """The request's connection inside one transaction: committed when the block ends,
    rolled back when it raises. READ COMMITTED (`db.connector`); a savepoint when the
    connection is already in a transaction (a test's)."""
    conn = connection()
    with driver_errors("transaction"), conn.transaction():
        yield conn


@contextlib.contextmanager
def probe() -> Iterator[psycopg.Connection[Any]]:
    """A new connection for the readiness probe and the queue gauges, closed afterwards.

    Unpooled, with the probe's short connect timeout. Raises a driver error when the
    server cannot be reached.
    """
    settings: dict[str, Any] = current_app.config["FAIRQ_PROBE"]
    with probe_for(settings) as conn:
        yield conn


@contextlib.contextmanager
def probe_for(settings: dict[str, Any]) -> Iterator[psycopg.Connection[Any]]:
    """`probe()` with the probe settings of an app (its `FAIRQ_PROBE` config)."""
    with driver_errors("connect"):
        conn = connector.connect(
            settings["url"],
            application_name=settings["application_name"],
            transaction_pooling=settings["transaction_pooling"],
            connect_timeout=settings["connect_timeout"],
        )
    with conn:
        yield conn
