"""The pass's way to the database: its sessions, and its writes, one thread at a time.

Given an engine, a pass holds one of its connections from start to end and runs every
write, each a single statement (the claim is one call of `fairq_claim`), in autocommit
(docs/decisions/0003). The pass and its lease keeper share that connection, so every
statement goes through `PassDatabase.write`, which serializes them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from db import engine as db_engine
from worker.processing.task_log import log

T = TypeVar("T")

SessionSource = Callable[[], Session] | Engine

# statement_timeout of a worker process's engine (children, `--once`; `db.engine.make_engine`),
# lock waits included: far above a normal claim's wait for the claimers' advisory lock, far
# below the minutes a call can hang on a dead network. The API's pass runs on the API's
# engine, without one.
WORKER_STATEMENT_TIMEOUT_MS = 30_000


@contextlib.contextmanager
def opened(sessions: SessionSource) -> Iterator[PassDatabase]:
    """The database of one pass: on a connection of `sessions` held throughout, if an engine."""
    if not isinstance(sessions, Engine):
        yield PassDatabase(sessions, None)
        return
    # One checkout for the whole pass. Returned to the pool at the end, where SQLAlchemy
    # resets the isolation level the pass changed.
    with sessions.connect() as connection:
        yield PassDatabase(lambda: Session(bind=connection, expire_on_commit=False), connection)


class PassDatabase:
    """Sessions for one pass, and `write`, which runs its statements one thread at a time."""

    def __init__(self, factory: Callable[[], Session], connection: Connection | None) -> None:
        self.session = factory
        # The connection every session shares, when the pass holds one: its writes then run
        # in autocommit.
        self._connection = connection
        self._autocommit = False
        self._lock = threading.Lock()

    def write(
        self,
        session: Session,
        statement: Callable[[], T],
        *,
        retry: bool = True,
    ) -> T:
        """Run the single statement `statement` sends, committed, one thread at a time.

        On the pass's own connection it runs in autocommit: the same atomicity as a
        transaction, two round trips (BEGIN, COMMIT) fewer. There it is sent once more on a
        new connection when the held one was lost, unless not `retry` (a statement whose
        second run would not be harmless, as a claim's).
        """
        with self._lock:
            try:
                self._ensure_autocommit()
                result = statement()
                session.commit()
            except DBAPIError as exc:
                session.rollback()
                if not retry or self._connection is None or not db_engine.is_transient(exc):
                    raise
                # The held connection may have died while a handler ran (a restart, a
                # failover, an idle timeout), and a held connection gets no pool ping. Once
                # more on a new one: the statement is fenced, so a write that did commit
                # changes nothing twice.
                log.info("database connection lost (%s); writing once more", type(exc).__name__)
                self._autocommit = False
                self._ensure_autocommit()
                result = statement()
                session.commit()
            except BaseException:
                session.rollback()
                raise
        return result

    def _ensure_autocommit(self) -> None:
        # Between transactions (`write` commits or rolls back every one), so switching is a
        # client-side setting of the driver, no round trip.
        if self._connection is None or self._autocommit:
            return
        self._connection.execution_options(isolation_level="AUTOCOMMIT")
        self._autocommit = True
