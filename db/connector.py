"""The one way to PostgreSQL at run time: psycopg connections, alone or from a pool.

Every runtime statement (API, worker, `db`) is sent by psycopg in its `%(name)s` dialect on
a connection made here: `connect` for one connection of its own (a worker's pass, the
readiness probe, LISTEN), `make_pool` for the API's `psycopg_pool.ConnectionPool`. Driver
errors reach callers translated once, by `db.engine.driver_errors` around each statement.
SQLAlchemy stays for the models, Alembic and the tests that check migrations
(docs/decisions/0008).
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import psycopg
from psycopg import IsolationLevel
from psycopg.rows import RowFactory, namedtuple_row
from psycopg_pool import ConnectionPool

# libpq parameters of every connection. Without them a call on a black-holed network (a
# failover, a dropped route) blocks for the kernel's retransmission timeout, about 15
# minutes: keepalives notice a dead idle peer after 10 + 3 * 5 s, and tcp_user_timeout (ms)
# bounds how long sent data may stay unacknowledged.
TCP_ARGS: dict[str, int] = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30_000,
}
# Seconds libpq waits for a connection to be made (libpq treats anything below 2 as 2).
CONNECT_TIMEOUT_SECONDS = 5


# Rows whose columns read as attributes (`row.name`), for `conn.cursor(row_factory=...)`;
# typed loosely, as the columns are the statement's.
NAMED_ROWS: RowFactory[Any] = namedtuple_row


def conninfo(url: str) -> str:
    """The libpq URL of `url`, which may name SQLAlchemy's driver (`postgresql+psycopg://`).

    Settings and deployments give one URL for both; libpq knows `postgresql://` only.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url  # a key=value conninfo string
    return f"{scheme.split('+', 1)[0]}://{rest}"


def connect_kwargs(
    *,
    application_name: str,
    statement_timeout_ms: int | None = None,
    transaction_pooling: bool = False,
    connect_timeout: int = CONNECT_TIMEOUT_SECONDS,
    autocommit: bool = True,
) -> dict[str, Any]:
    """The keyword arguments of `psycopg.connect` for a fairq connection.

    Autocommit by default: a statement alone commits by itself, and work of several takes
    `with conn.transaction():` (BEGIN ... COMMIT; a savepoint when one is open).
    `statement_timeout_ms` (workers only: migrations and the API's views may legitimately
    run long) makes the server cancel any statement, lock waits included, after that long.

    `transaction_pooling`: the URL is a transaction pooler (PgBouncer's `pool_mode =
    transaction`), which hands each transaction whichever server connection is free. Then no
    statement is prepared by name (psycopg's `prepare_threshold`: a name prepared on one
    server connection is unknown, or already taken, on the next) and no startup `options`
    are sent (PgBouncer refuses them), so `statement_timeout_ms` is not applied: set
    `statement_timeout` on the database role or PgBouncer's `query_timeout` instead.
    """
    kwargs: dict[str, Any] = {
        "application_name": application_name,
        "connect_timeout": connect_timeout,
        "autocommit": autocommit,
        **TCP_ARGS,
    }
    if transaction_pooling:
        kwargs["prepare_threshold"] = None
    elif statement_timeout_ms is not None:
        kwargs["options"] = f"-c statement_timeout={int(statement_timeout_ms)}"
    return kwargs


def connect(url: str, **kwargs: Any) -> psycopg.Connection[Any]:
    """One connection of its own, not pooled; `kwargs` as `connect_kwargs` takes them.

    Transactions it opens run under READ COMMITTED, whatever the server's default: the
    queue's statements are written for it (db/queue.py, db/claims.py). Raises
    `psycopg.OperationalError` when the server cannot be reached.
    """
    conn = psycopg.connect(conninfo(url), **connect_kwargs(**kwargs))
    _configure(conn)
    return conn


def _configure(conn: psycopg.Connection[Any]) -> None:
    conn.isolation_level = IsolationLevel.READ_COMMITTED


# Seconds a request waits for a pooled connection before its 503: the pool opens connections
# in the background and retries with backoff, so a longer wait only delays the answer in an
# outage; in normal work a connection is back in the pool within a request's time.
POOL_WAIT_SECONDS = 1.0
# How long the pool keeps retrying one failed connection attempt before it gives up; the
# next request that needs a connection starts a new attempt at once, so the pool is back
# within about this long after the server is.
POOL_RECONNECT_SECONDS = 0.5


def make_pool(
    url: str,
    *,
    application_name: str,
    min_size: int,
    max_size: int,
    statement_timeout_ms: int | None = None,
    transaction_pooling: bool = False,
    connect_timeout: int = CONNECT_TIMEOUT_SECONDS,
) -> ConnectionPool[psycopg.Connection[Any]]:
    """A pool of connections as `connect` makes them, in autocommit; opened by its first
    `checkout` (an app or a process that never queries never connects).

    `min_size` connections are kept open, up to `max_size` at busy times; they are opened in
    the background, retried while the server is down. Take and give back its connections
    with `checkout` and `checkin`. The other arguments as `connect_kwargs` takes them.
    """
    return ConnectionPool(
        conninfo(url),
        kwargs=connect_kwargs(
            application_name=application_name,
            statement_timeout_ms=statement_timeout_ms,
            transaction_pooling=transaction_pooling,
            connect_timeout=connect_timeout,
        ),
        min_size=min_size,
        max_size=max_size,
        open=False,
        configure=_configure,
        name=application_name,
        timeout=POOL_WAIT_SECONDS,
        reconnect_timeout=POOL_RECONNECT_SECONDS,
    )


# When each pooled connection was given back (`checkin`), for `checkout`'s ping.
_IDLE_SINCE: weakref.WeakKeyDictionary[psycopg.Connection[Any], float] = weakref.WeakKeyDictionary()


# Seconds a pooled connection may idle before `checkout` pings it.
PING_AFTER_IDLE_SECONDS = 1.0


def checkout(
    pool: ConnectionPool[psycopg.Connection[Any]],
    *,
    ping_after_idle: float | None = None,
) -> psycopg.Connection[Any]:
    """A connection of `pool`; give it back with `checkin`.

    One idle in the pool longer than `ping_after_idle` seconds (`PING_AFTER_IDLE_SECONDS`
    when not given) is checked first with an
    empty query: after a restart or an outage every pooled connection has been idle, so none
    reaches its caller dead. A dead one is dropped, and with it every idle connection of the
    pool (they were most likely lost with it, and each would fail a caller of its own); the
    pool opens new ones at once. A busy connection is not checked, to spare the round trip.
    Raises `psycopg_pool.PoolTimeout` after `POOL_WAIT_SECONDS` without a connection (the
    server is down, or the pool is exhausted).
    """
    pool.open()  # once; then a no-op
    conn = pool.getconn()
    since = _IDLE_SINCE.pop(conn, None)
    if ping_after_idle is None:
        ping_after_idle = PING_AFTER_IDLE_SECONDS
    if since is None or time.monotonic() - since <= ping_after_idle:
        return conn
    try:
        ConnectionPool.check_connection(conn)
    except psycopg.Error:
        pool.putconn(conn)  # broken: the pool closes it
        pool.drain()
        conn = pool.getconn()
    return conn


def checkin(pool: ConnectionPool[psycopg.Connection[Any]], conn: psycopg.Connection[Any]) -> None:
    """Give back a connection of `checkout`; a lost one makes the pool replace the others."""
    if conn.broken:
        pool.putconn(conn)
        pool.drain()
        return
    _IDLE_SINCE[conn] = time.monotonic()
    pool.putconn(conn)
