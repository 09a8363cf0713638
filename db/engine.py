"""Engine and session construction: the only place that calls `create_engine`."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, create_engine
from sqlalchemy.orm import Session, sessionmaker


def make_engine(url: str, *, application_name: str = "fairq", **kwargs: Any) -> Engine:
    """Build an engine for a `postgresql+psycopg://` URL.

    `pool_pre_ping` lets a process survive a database restart: a dead pooled connection is
    replaced instead of failing the next request. `hide_parameters`: an error's text (and so
    a logged traceback) never shows bound values, which include task payloads. Extra keyword
    arguments go to `create_engine` (tests pass `poolclass`).
    """
    connect_args = kwargs.pop("connect_args", {})
    connect_args.setdefault("application_name", application_name)
    connect_args.setdefault("connect_timeout", 5)
    kwargs.setdefault("hide_parameters", True)
    return create_engine(url, pool_pre_ping=True, connect_args=connect_args, **kwargs)


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    """Session factory whose objects stay readable after commit (views serialize them)."""
    return sessionmaker(bind=engine, expire_on_commit=False)
