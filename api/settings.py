"""API settings: the only place the API process reads the environment (design §8).

Built on the same parsers as the worker's (`common.environment`), which also read, with their
one default, the variables the two share: `DATABASE_URL`, `DATABASE_POOL_MODE`, logging, the
stale window, the notify channel and the handlers' settings.
"""

from __future__ import annotations

import math
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
# The admin token must be at least this long, and its estimate (`admin_token_bits`) at least
# this many bits: `python -c 'import secrets; print(secrets.token_urlsafe(32))'` gives 43
# characters and 256 random bits.
MIN_ADMIN_TOKEN_LENGTH = 32
MIN_ADMIN_TOKEN_BITS = 128
# Tokens published in fairq's files and their history: whoever read them knows them.
PUBLISHED_ADMIN_TOKENS = frozenset({"change-me-please-0123456789"})
MAKE_ADMIN_TOKEN = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"  # noqa: S105  (a command, not a token)
# Failed authentications from one client address before it is refused for the rest of a
# minute (api.throttle): an operator's typos pass, a guesser gets 10 tries a minute.
DEFAULT_AUTH_FAILURE_LIMIT = 10
# Reverse proxies in front of the API that append to X-Forwarded-For, at most.
MAX_PROXY_HOPS = 5


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
    `proxy_hops`: `PROXY_HOPS`, how many reverse proxies in front of the API append the
    client's address to `X-Forwarded-For` (0: none, the peer's address is the client's; it
    is what failed authentications are counted against: `api.throttle`);
    `auth_failure_limit`: failed authentications from one client address within a window
    before it is refused (`api.throttle`; not from the environment);
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
    proxy_hops: int = 0
    auth_failure_limit: int = DEFAULT_AUTH_FAILURE_LIMIT
    handler_config: HandlerConfig = field(default_factory=HandlerConfig)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ApiSettings:
        """Read settings from `environ` (default `os.environ`).

        Raises `SettingsError` naming the variable when a value is missing or invalid.
        """
        env = os.environ if environ is None else environ
        # Stripped like every other variable: the bearer token a client sends is stripped too.
        token = env.get("ADMIN_TOKEN", "").strip() or None
        if token is not None:
            check_admin_token(token)
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
            proxy_hops=env_int(env, "PROXY_HOPS", 0, minimum=0, maximum=MAX_PROXY_HOPS),
        )


def admin_token_bits(token: str) -> float:
    """A rough upper estimate of a token's entropy in bits: log2(distinct characters) for each
    character that does not start a repeat of an earlier run of three (`abcabcabc` counts 3).

    It sees that a token is short or repetitive, not that it is made of words: a token from
    `secrets` is what the checks are for (`check_admin_token`). 43 characters of
    `token_urlsafe(32)` score about 200; 32 of `token_urlsafe(24)` fall below 128 about once
    in 500,000.
    """
    distinct = len(set(token))
    if distinct < 2:
        return 0.0
    seen: set[str] = set()
    new = 0
    for start in range(len(token)):
        run = token[start : start + 3]
        new += run not in seen
        seen.add(run)
    return new * math.log2(distinct)


def check_admin_token(token: str) -> None:
    """Refuse an admin token that can be guessed: a published placeholder, shorter than
    `MIN_ADMIN_TOKEN_LENGTH`, or under `MIN_ADMIN_TOKEN_BITS` by `admin_token_bits`.

    Raises `SettingsError` naming `ADMIN_TOKEN`, saying how to make a good one.
    """
    how = f"make one with: {MAKE_ADMIN_TOKEN}"
    if token in PUBLISHED_ADMIN_TOKENS or "change-me" in token.lower():
        raise SettingsError(f"ADMIN_TOKEN is the published placeholder, known to anyone: {how}")
    if len(token) < MIN_ADMIN_TOKEN_LENGTH:
        raise SettingsError(
            f"ADMIN_TOKEN must be at least {MIN_ADMIN_TOKEN_LENGTH} characters long: {how}"
        )
    if admin_token_bits(token) < MIN_ADMIN_TOKEN_BITS:
        raise SettingsError(
            f"ADMIN_TOKEN is too repetitive to be random (too few distinct characters): {how}"
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
