"""API settings: the only place the API process reads the environment (design §8)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from worker.settings import (
    SettingsError,
    env_float,
    env_logging,
    env_str,
    env_url,
    handler_config_from_env,
)
from worker.tasktypes.base import HandlerConfig


@dataclass(frozen=True)
class ApiSettings:
    """Settings of one API process, validated at start.

    `admin_token`: bearer token for admin endpoints, or None (they then answer 503);
    `notify_channel`: PostgreSQL channel woken on task creation (shared with the worker);
    `ready_timeout_ms`: statement timeout of the readiness probe and the queue collector;
    `metrics_multiprocess`: `PROMETHEUS_MULTIPROC_DIR` is set (under gunicorn);
    `log_level`, `log_format`: `LOG_LEVEL` and `LOG_FORMAT`, as for the worker;
    `handler_config`: what the handlers of `POST /workers/process` use, read from the same
    variables as the worker's (`SMTP_URL`, `WEBHOOK_ALLOW_PRIVATE`, ...).
    """

    database_url: str
    admin_token: str | None = None
    notify_channel: str = "fairq_tasks"
    ready_timeout_ms: int = 1000
    max_body_bytes: int = 1024 * 1024
    stale_after_seconds: float = 300.0
    metrics_multiprocess: bool = False
    log_level: str = "INFO"
    log_format: str = "text"
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
        return cls(
            database_url=env_url(env),
            admin_token=token,
            notify_channel=env_str(env, "NOTIFY_CHANNEL", "fairq_tasks"),
            stale_after_seconds=env_float(env, "STALE_AFTER_SECONDS", 300.0, minimum=1.0),
            metrics_multiprocess=bool(env.get("PROMETHEUS_MULTIPROC_DIR", "").strip()),
            log_level=log_level,
            log_format=log_format,
            handler_config=handler_config_from_env(env),
        )
