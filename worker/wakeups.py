"""The wake-up listener of a worker child: LISTEN on the task channel (design §4).

NOTIFY is only a hint that work arrived: a child that misses one finds the work on its next
poll. The listener holds a session of its own, so behind a transaction pooler it connects to
`LISTEN_DATABASE_URL` or not at all (`WorkerSettings.listen_url`).
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from db import connector

# application_name of the listener's connection (operators and tests find it by it).
LISTEN_APPLICATION_NAME = "fairq-worker-listen"


class Listener:
    """A dedicated autocommit connection that LISTENs on the task channel.

    `fileno()` is None while disconnected; `drain()` returns how many notifications were
    waiting, and raises `psycopg.Error` (after closing) when the connection is gone. With no
    `database_url` (`WorkerSettings.listen_url`) it never connects: the child only polls.
    """

    def __init__(self, database_url: str | None, channel: str) -> None:
        self._url = database_url
        self._channel = channel
        self._conn: psycopg.Connection[Any] | None = None

    @property
    def enabled(self) -> bool:
        """Whether there is a URL to LISTEN on."""
        return self._url is not None

    def connect(self) -> None:
        """Open the connection and LISTEN; raises `psycopg.Error` on failure."""
        self.close()
        if self._url is None:
            return
        # The connector's keepalives matter most here: an idle listener on a black-holed
        # network would otherwise wait for a NOTIFY that can never arrive, without noticing.
        conn = connector.connect(self._url, application_name=LISTEN_APPLICATION_NAME)
        try:
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))
        except BaseException:
            conn.close()
            raise
        self._conn = conn

    def fileno(self) -> int | None:
        """The socket to wait on, or None while disconnected."""
        return None if self._conn is None else self._conn.fileno()

    def drain(self) -> int:
        """Consume every notification already received; return how many."""
        if self._conn is None:
            return 0
        try:
            return sum(1 for _ in self._conn.notifies(timeout=0))
        except psycopg.Error:
            self.close()
            raise

    def close(self) -> None:
        """Close the connection, if open."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
