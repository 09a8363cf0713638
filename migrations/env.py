"""Alembic environment: migrates the database named by the config URL or `DATABASE_URL`."""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import pool

from db import models
from db.engine import make_engine

config = context.config
target_metadata = models.Base.metadata


def _url() -> str:
    # Tests and scripts set the URL on the config; processes read the environment.
    url = None
    if config.file_config.has_section(config.config_ini_section):
        url = config.get_main_option("sqlalchemy.url")
    url = url or os.environ.get("DATABASE_URL")
    if not url:
        raise SystemExit("DATABASE_URL is not set: it must name the database to migrate")
    return url


def run_migrations_offline() -> None:
    """Emit SQL to stdout instead of running it (`alembic upgrade --sql`)."""
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    """Run migrations in one transaction on a fresh, unpooled connection."""
    engine = make_engine(_url(), application_name="fairq-migrate", poolclass=pool.NullPool)
    try:
        with engine.connect() as connection:
            context.configure(connection=connection, target_metadata=target_metadata)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
