"""Per-request database sessions bound to the app's engine, and the readiness probe's engine."""

from __future__ import annotations

import math

from flask import Flask, current_app, g
from sqlalchemy import Engine, pool
from sqlalchemy.orm import Session, sessionmaker

from db.engine import make_engine, make_sessionmaker

_EXT = "fairq.database"
_PROBE_EXT = "fairq.database.probe"
# libpq (and psycopg) take whole seconds and treat anything below 2 as 2.
MIN_CONNECT_TIMEOUT_SECONDS = 2


def init_app(app: Flask, database_url: str, *, transaction_pooling: bool = False) -> None:
    """Create the app's engines and close the request's session at teardown.

    Besides the pooled engine of the views, a probe engine for `/ready`: no pool (each probe
    opens a fresh connection, so it proves the server accepts connections, and never waits
    on a pooled socket to a hung server) and a connect timeout derived from the readiness
    timeout (`FAIRQ_SETTINGS.ready_timeout_ms`) instead of the views' 5 seconds.
    `transaction_pooling`: `database_url` is a transaction pooler (`db.engine.make_engine`).
    """
    engine = make_engine(
        database_url, application_name="fairq-api", transaction_pooling=transaction_pooling
    )
    app.extensions[_EXT] = (engine, make_sessionmaker(engine))
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
        session: Session | None = g.pop("db_session", None)
        if session is not None:
            session.close()


def engine_of(app: Flask) -> Engine:
    """The pooled engine of `app` (views reach it through `session()`)."""
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
    """The request's session, created on first use; views commit it once at the end."""
    if "db_session" not in g:
        pair: tuple[Engine, sessionmaker[Session]] = current_app.extensions[_EXT]
        g.db_session = pair[1]()
    current: Session = g.db_session
    return current


def session_factory() -> sessionmaker[Session]:
    """The current app's session factory, for work that needs sessions of its own.

    A processing pass (`POST /workers/process`) opens one per thread; views use `session()`.
    """
    pair: tuple[Engine, sessionmaker[Session]] = current_app.extensions[_EXT]
    return pair[1]
