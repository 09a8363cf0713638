"""The pass's way to the database: one connection, and its writes, one thread at a time.

A pass holds one connection from start to end and runs every write, each a single statement
(the claim is one call of `fairq_claim`), in autocommit (docs/decisions/0003). The pass and
its lease keeper share that connection, so every statement goes through `PassDatabase.write`,
which serializes them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import psycopg
from psycopg_pool import ConnectionPool
from sqlalchemy.exc import DBAPIError

from db import connector
from db import engine as db_engine
from db.engine import driver_errors
from worker.processing.task_log import log

T = TypeVar("T")

# Where a pass's connection comes from: a pool (a worker child's, `--once`'s), whose
# connection the pass takes for its whole length, or a connection its caller holds (the
# API's request connection, in autocommit; a test's, inside its transaction).
ConnectionSource = ConnectionPool[psycopg.Connection[Any]] | psycopg.Connection[Any]

# statement_timeout of a worker process's connections (children, `--once`;
# `db.connector.connect_kwargs`), lock waits included: far above a normal claim's wait for the
# claimers' advisory lock, far below the minutes a call can hang on a dead network. The
# API's pass runs on the API's connection, without one.
WORKER_STATEMENT_TIMEOUT_MS = 30_000


@contextlib.contextmanager
def opened(source: ConnectionSource) -> Iterator[PassDatabase]:
    """The database of one pass: a connection of `source` held throughout, or `source`."""
    if isinstance(source, psycopg.Connection):
        yield PassDatabase(source, None)
        return
    with driver_errors("connect"):
        conn = connector.checkout(source)
    db = PassDatabase(conn, source)
    try:
        yield db
    finally:
        connector.checkin(source, db.conn)


class PassDatabase:
    """The pass's connection, and `write`, which runs its statements one thread at a time."""

    def __init__(
        self, conn: psycopg.Connection[Any], pool: ConnectionPool[psycopg.Connection[Any]] | None
    ) -> None:
        self.conn = conn
        # The pool the connection came from, if the pass took it: a lost one is then
        # replaced by another of the pool.
        self._pool = pool
        self._lock = threading.Lock()

    def write(
        self,
        statement: Callable[[psycopg.Connection[Any]], T],
        *,
        retry: bool = True,
    ) -> T:
        """Run the single statement `statement` sends on the connection, one thread at a time.

        In autocommit it commits by itself: the same atomicity as a transaction, two round
        trips (BEGIN, COMMIT) fewer. On a connection the pass took from a pool it is sent once
        more on a new connection when the held one was lost, unless not `retry` (a statement
        whose second run would not be harmless, as a claim's).
        """
        with self._lock:
            try:
                return statement(self.conn)
            except DBAPIError as exc:
                if not retry or self._pool is None or not db_engine.is_transient(exc):
                    raise
                # The held connection may have died while a handler ran (a restart, a
                # failover, an idle timeout), and a held connection gets no pool ping. Once
                # more on a new one: the statement is fenced, so a write that did commit
                # changes nothing twice.
                log.info("database connection lost (%s); writing once more", type(exc).__name__)
                connector.checkin(self._pool, self.conn)
                with driver_errors("connect"):
                    self.conn = connector.checkout(self._pool)
                return statement(self.conn)
