"""Per-request database sessions bound to the app's engine."""

from __future__ import annotations

from flask import Flask, current_app, g
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from db.engine import make_engine, make_sessionmaker

_EXT = "fairq.database"


def init_app(app: Flask, database_url: str) -> None:
    """Create the app's engine and close the request's session at teardown."""
    engine = make_engine(database_url, application_name="fairq-api")
    app.extensions[_EXT] = (engine, make_sessionmaker(engine))

    @app.teardown_appcontext
    def _close_session(_exc: BaseException | None) -> None:
        session: Session | None = g.pop("db_session", None)
        if session is not None:
            session.close()


def engine_of(app: Flask) -> Engine:
    """The engine of `app`."""
    pair: tuple[Engine, sessionmaker[Session]] = app.extensions[_EXT]
    return pair[0]


def engine() -> Engine:
    """The current app's engine."""
    return engine_of(current_app)


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
