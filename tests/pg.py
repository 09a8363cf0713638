"""The test PostgreSQL server: `TEST_DATABASE_URL`, or an embedded PostgreSQL 16.

Databases: a template migrated once by `alembic upgrade head`, then copies of it
(`CREATE DATABASE ... TEMPLATE`), which takes milliseconds.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from alembic import command
from alembic.config import Config
from psycopg_pool import ConnectionPool
from sqlalchemy import Engine
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from db import connector
from devtools.embedded_postgres import EmbeddedPostgres, free_port
from worker.processing.database import WORKER_STATEMENT_TIMEOUT_MS

ROOT = Path(__file__).resolve().parent.parent
# Per test session, so concurrent sessions (or a developer's run beside CI's) never share one.
TEMPLATE_DB = f"fairq_test_template_{os.getpid()}"
EMBEDDED_PREFIX = "test-"


def alembic_config(url: str) -> Config:
    """Alembic config from pyproject.toml, pointed at `url`."""
    cfg = Config(toml_file=str(ROOT / "pyproject.toml"))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def libpq(url: str) -> str:
    """A SQLAlchemy URL as a libpq connection string for psycopg."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


class TestServer:
    """A server the test session may create and drop databases on."""

    def __init__(self, base_url: str, embedded: EmbeddedPostgres | None):
        self.base_url = base_url
        self.embedded = embedded

    def url(self, database: str) -> str:
        """URL of `database` on this server."""
        return make_url(self.base_url).set(database=database).render_as_string(hide_password=False)

    def _admin(self, sql: str) -> None:
        with psycopg.connect(libpq(self.base_url), autocommit=True) as conn:
            conn.execute(sql)

    def drop(self, name: str) -> None:
        """Drop `name`, disconnecting its sessions."""
        self._admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def build_template(self) -> str:
        """(Re)create the template database by running every migration; return its URL."""
        self.drop(TEMPLATE_DB)
        self._admin(f'CREATE DATABASE "{TEMPLATE_DB}"')
        command.upgrade(alembic_config(self.url(TEMPLATE_DB)), "head")
        return self.url(TEMPLATE_DB)

    def create_from_template(self, prefix: str = "fairq_test") -> str:
        """A fresh database copied from the template; return its name."""
        name = f"{prefix}_{uuid.uuid4().hex[:12]}"
        self._admin(f'CREATE DATABASE "{name}" TEMPLATE "{TEMPLATE_DB}"')
        return name

    def create_empty(self, prefix: str = "fairq_test_empty") -> str:
        """An empty database (no schema); return its name."""
        name = f"{prefix}_{uuid.uuid4().hex[:12]}"
        self._admin(f'CREATE DATABASE "{name}"')
        return name


@contextmanager
def test_server() -> Iterator[TestServer]:
    """Yield the server named by `TEST_DATABASE_URL`, else start an embedded one."""
    configured = os.environ.get("TEST_DATABASE_URL", "").strip()
    if configured:
        url = configured
        if url.startswith("postgresql://"):
            url = "postgresql+psycopg://" + url[len("postgresql://") :]
        yield TestServer(url, None)
        return
    _remove_abandoned_servers()
    embedded = EmbeddedPostgres(
        ROOT / ".pgdata" / f"{EMBEDDED_PREFIX}{os.getpid()}",
        free_port(),
        # Durability is irrelevant for throwaway test data; speed is not.
        options={"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off",
                 "max_connections": "300"},
    )  # fmt: skip
    embedded.start()
    try:
        yield TestServer(embedded.url("postgres"), embedded)
    finally:
        embedded.destroy()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_abandoned_servers() -> None:
    """Delete embedded test servers whose test session died without cleaning up."""
    base = ROOT / ".pgdata"
    if not base.is_dir():
        return
    for datadir in base.glob(f"{EMBEDDED_PREFIX}*"):
        suffix = datadir.name.removeprefix(EMBEDDED_PREFIX)
        if not datadir.is_dir() or not suffix.isdigit() or _pid_alive(int(suffix)):
            continue
        EmbeddedPostgres(datadir, free_port()).destroy()


@contextmanager
def worker_pool(
    target: Engine | sessionmaker[Session], application_name: str = "fairq-tests-worker"
) -> Iterator[ConnectionPool[psycopg.Connection[Any]]]:
    """A worker child's pool (one connection, worker statement timeout) on `target`'s
    database, closed afterwards: what `processing.run_pass` takes."""
    engine = target if isinstance(target, Engine) else target.kw["bind"]
    assert isinstance(engine, Engine)
    pool = connector.make_pool(
        engine.url.render_as_string(hide_password=False),
        application_name=application_name,
        statement_timeout_ms=WORKER_STATEMENT_TIMEOUT_MS,
        min_size=1,
        max_size=1,
    )
    try:
        yield pool
    finally:
        pool.close()
