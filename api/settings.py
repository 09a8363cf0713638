"""API settings: the only place the API process reads the environment (design §8).

Built on the same parsers as the worker's (`common.environment`), which also read, with their
one default, the variables the two share: `DATABASE_URL`, `DATABASE_POOL_MODE`, logging, the
stale window, the notify channel and the handlers' settings.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import flask

from common.environment import (
    DEFAULT_LOG_FORMAT,
    DEFAULT_LOG_LEVEL,
    DEFAULT_NOTIFY_CHANNEL,
    DEFAULT_POOL_MODE,
    DEFAULT_STALE_AFTER_SECONDS,
    SettingsError,
    env_int,
    env_logging,
    env_notify_channel,
    env_pool_mode,
    env_stale_after,
    env_url,
)
from db import tenant_stats
from db.models import MAX_PENDING, MIN_PENDING
from worker.tasktypes.base import HandlerConfig

# Where `init_app` keeps the app's settings in its config; read only through `current`.
_CONFIG_KEY = "FAIRQ_SETTINGS"

# A new company's max_pending when POST /companies gives none: room for a large backlog, but
# not for one tenant's runaway producer to fill the database.
DEFAULT_MAX_PENDING = 1_000_000
# Statement timeout of each statistics query (GET /stats, /companies/{id}/stats): the longest
# takes ~50 ms at 1M tasks and 20,000 companies (scripts/bench_stats.py), so 2 s is room for a
# loaded server; at most gunicorn's default worker timeout.
DEFAULT_STATS_TIMEOUT_MS = 2000
MAX_STATS_TIMEOUT_MS = 30_000
# A dashboard login lasts a working day, then the operator enters the admin token again; at
# most a week, so a stolen session cookie does not outlive a token rotation by much.
DEFAULT_DASHBOARD_SESSION_HOURS = 8
MAX_DASHBOARD_SESSION_HOURS = 168


@dataclass(frozen=True)
class ApiSettings:
    """Settings of one API process, validated at start.

    `database_pool_mode`: `DATABASE_POOL_MODE`, as for the worker;
    `database_pool_size`: pooled connections kept per process, `GUNICORN_THREADS` (a request
    holds one connection at a time, so one per thread; design §3 "Connections");
    `admin_token`: bearer token for admin endpoints, or None (they then answer 503);
    `notify_channel`: PostgreSQL channel woken on task creation (shared with the worker);
    `ready_timeout_ms`: statement timeout of the readiness probe and the queue collector;
    `max_body_bytes`: the largest request body, the single create's (413 above it);
    `max_batch_body_bytes`: the same for POST /companies/{id}/task-batches: room for its 1,000
    tasks at 8 KiB each on average (a payload alone may take 64 KiB), while the JSON parse of
    a body at the limit stays well under a second;
    `metrics_dir`: `PROMETHEUS_MULTIPROC_DIR`, where every gunicorn worker writes its metrics
    files, or None outside gunicorn (one process, its own registry);
    `log_level`, `log_format`: `LOG_LEVEL` and `LOG_FORMAT`, as for the worker;
    `default_max_pending`: `DEFAULT_MAX_PENDING`, a new company's `max_pending` when its create
    gives none (None: unlimited, from the value `unlimited`);
    `dashboard_session_hours`: `DASHBOARD_SESSION_HOURS`, how long a dashboard login lasts
    (absolute, from the login; the session cookie is signed with a key derived from the admin
    token, so changing `ADMIN_TOKEN` also ends every session: `api.dashboard`);
    `stats_timeout_ms`: `STATS_TIMEOUT_MS`, the statement timeout of each statistics query
    (past it the endpoint answers 503); `stats_limits`: where their exact counts stop
    (`db.tenant_stats.Limits`; not from the environment);
    `handler_config`: what the handlers of `POST /workers/process` use, read from the same
    variables as the worker's (`SMTP_URL`, `WEBHOOK_ALLOW_PRIVATE`, ...).
    """

    database_url: str
    database_pool_mode: str = DEFAULT_POOL_MODE
    database_pool_size: int = 4
    admin_token: str | None = None
    notify_channel: str = DEFAULT_NOTIFY_CHANNEL
    ready_timeout_ms: int = 1000
    max_body_bytes: int = 1024 * 1024
    max_batch_body_bytes: int = 8 * 1024 * 1024
    stale_after_seconds: float = DEFAULT_STALE_AFTER_SECONDS
    metrics_dir: Path | None = None
    log_level: str = DEFAULT_LOG_LEVEL
    log_format: str = DEFAULT_LOG_FORMAT
    default_max_pending: int | None = DEFAULT_MAX_PENDING
    dashboard_session_hours: int = DEFAULT_DASHBOARD_SESSION_HOURS
    stats_timeout_ms: int = DEFAULT_STATS_TIMEOUT_MS
    stats_limits: tenant_stats.Limits = field(default_factory=tenant_stats.Limits)
    handler_config: HandlerConfig = field(default_factory=HandlerConfig)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ApiSettings:
        """Read settings from `environ` (default `os.environ`).

        Raises `SettingsError` naming the variable when a value is missing or invalid.
        """
        env = os.environ if environ is None else environ
        # Stripped like every other variable: the bearer token a client sends is stripped too.
        token = env.get("ADMIN_TOKEN", "").strip() or None
        if token is not None and len(token) < 16:
            raise SettingsError("ADMIN_TOKEN must be at least 16 characters long")
        log_level, log_format = env_logging(env)
        metrics_dir = env.get("PROMETHEUS_MULTIPROC_DIR", "").strip()
        return cls(
            database_url=env_url(env),
            database_pool_mode=env_pool_mode(env),
            # The same variable and default as deploy/gunicorn.conf.py's `threads`.
            database_pool_size=env_int(env, "GUNICORN_THREADS", 4, minimum=1, maximum=1000),
            admin_token=token,
            notify_channel=env_notify_channel(env),
            stale_after_seconds=env_stale_after(env),
            metrics_dir=Path(metrics_dir) if metrics_dir else None,
            log_level=log_level,
            log_format=log_format,
            default_max_pending=_env_default_max_pending(env),
            dashboard_session_hours=env_int(
                env,
                "DASHBOARD_SESSION_HOURS",
                DEFAULT_DASHBOARD_SESSION_HOURS,
                minimum=1,
                maximum=MAX_DASHBOARD_SESSION_HOURS,
            ),
            stats_timeout_ms=env_int(
                env,
                "STATS_TIMEOUT_MS",
                DEFAULT_STATS_TIMEOUT_MS,
                minimum=100,
                maximum=MAX_STATS_TIMEOUT_MS,
            ),
            handler_config=HandlerConfig.from_env(env),
        )


def _env_default_max_pending(env: Mapping[str, str]) -> int | None:
    if env.get("DEFAULT_MAX_PENDING", "").strip().lower() == "unlimited":
        return None
    return env_int(
        env, "DEFAULT_MAX_PENDING", DEFAULT_MAX_PENDING, minimum=MIN_PENDING, maximum=MAX_PENDING
    )


def init_app(app: flask.Flask, settings: ApiSettings) -> None:
    """Make `settings` the app's: what `current()` returns while it handles a request."""
    app.config[_CONFIG_KEY] = settings


def current() -> ApiSettings:
    """The settings of the app in the current app context (`create_app`'s).

    Raises `RuntimeError` outside an app context, `KeyError` for an app built without
    `init_app`.
    """
    settings: ApiSettings = flask.current_app.config[_CONFIG_KEY]
    return settings
