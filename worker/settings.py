"""Worker settings: the only place worker processes read the environment (design §8).

Also holds the small environment parsers the API settings reuse, so every variable is
validated the same way and every error names its variable.
"""

from __future__ import annotations

import os
from collections import ChainMap
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from worker.tasktypes.base import HandlerConfig


class SettingsError(ValueError):
    """A configuration variable is missing or invalid; the message names the variable."""


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def env_str(env: Mapping[str, str], name: str, default: str) -> str:
    """`env[name]` stripped, or `default` when unset or blank."""
    value = env.get(name, "").strip()
    return value or default


def env_url(env: Mapping[str, str], name: str = "DATABASE_URL") -> str:
    """A SQLAlchemy URL for psycopg 3; a bare `postgresql://` URL is upgraded to it.

    Raises `SettingsError` when unset or not a PostgreSQL URL.
    """
    value = env.get(name, "").strip()
    if not value:
        raise SettingsError(f"{name} is not set (e.g. postgresql+psycopg://user@host/db)")
    for prefix in ("postgresql://", "postgres://"):
        if value.startswith(prefix):
            value = "postgresql+psycopg://" + value[len(prefix) :]
    if not value.startswith("postgresql+psycopg://"):
        raise SettingsError(f"{name} must be a postgresql+psycopg:// URL, got {value[:30]!r}")
    return value


def env_int(env: Mapping[str, str], name: str, default: int, *, minimum: int, maximum: int) -> int:
    """An integer in [minimum, maximum]; raises `SettingsError` naming `name` otherwise."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{name} must be an integer, got {raw!r}") from None
    if not minimum <= value <= maximum:
        raise SettingsError(f"{name} must be between {minimum} and {maximum}, got {value}")
    return value


def env_float(
    env: Mapping[str, str], name: str, default: float, *, minimum: float, maximum: float = 1e9
) -> float:
    """A finite number in [minimum, maximum]; raises `SettingsError` naming `name` otherwise."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{name} must be a number, got {raw!r}") from None
    if not minimum <= value <= maximum:  # also rejects nan
        raise SettingsError(f"{name} must be between {minimum} and {maximum}, got {raw}")
    return value


def env_logging(env: Mapping[str, str]) -> tuple[str, str]:
    """`LOG_LEVEL` (default INFO) and `LOG_FORMAT` (text or json, default text), validated.

    Shared by the worker and the API, so both accept the same values.
    """
    log_level = env_str(env, "LOG_LEVEL", "INFO").upper()
    if log_level not in LOG_LEVELS:
        raise SettingsError(f"LOG_LEVEL must be one of {', '.join(LOG_LEVELS)}")
    log_format = env_str(env, "LOG_FORMAT", "text").lower()
    if log_format not in ("text", "json"):
        raise SettingsError("LOG_FORMAT must be text or json")
    return log_level, log_format


def env_bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    """true/false, 1/0, yes/no, on/off (case-insensitive)."""
    raw = env.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise SettingsError(f"{name} must be true or false, got {raw!r}")


@dataclass(frozen=True)
class WorkerSettings:
    """Settings of the worker supervisor and its children, validated at start.

    Durations are seconds. `heartbeat_interval` defaults to `stale_after / 5` (design §4).
    """

    database_url: str
    concurrency: int = 2
    batch_size: int = 100
    poll_interval: float = 1.0
    stale_after: float = 300.0
    heartbeat_interval: float | None = None
    shutdown_timeout: float = 30.0
    boot_timeout: float = 60.0
    metrics_port: int = 9100
    metrics_host: str = "0.0.0.0"  # noqa: S104  (metrics are scraped from other hosts)
    prometheus_multiproc_dir: Path | None = None
    retention_days: float = 7.0
    log_level: str = "INFO"
    log_format: str = "text"
    notify_channel: str = "fairq_tasks"
    handler_config: HandlerConfig = field(default_factory=HandlerConfig)

    @property
    def effective_heartbeat_interval(self) -> float:
        """Seconds between lease refreshes while a batch runs."""
        return self.heartbeat_interval or self.stale_after / 5

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, overrides: Mapping[str, str] | None = None
    ) -> WorkerSettings:
        """Read settings from `environ` (default `os.environ`), `overrides` taking precedence.

        `overrides` maps variable names to values given another way (the worker's command-line
        flags), so they are validated exactly like the environment. Raises `SettingsError`
        naming the variable when a value is missing or invalid.
        """
        env: Mapping[str, str] = os.environ if environ is None else environ
        if overrides:
            env = ChainMap(dict(overrides), dict(env))
        log_level, log_format = env_logging(env)
        multiproc = env.get("PROMETHEUS_MULTIPROC_DIR", "").strip()
        return cls(
            database_url=env_url(env),
            concurrency=env_int(env, "WORKER_CONCURRENCY", 2, minimum=1, maximum=256),
            batch_size=env_int(env, "WORKER_BATCH_SIZE", 100, minimum=1, maximum=10_000),
            poll_interval=env_float(env, "WORKER_POLL_INTERVAL", 1.0, minimum=0.01, maximum=3600),
            stale_after=env_float(env, "STALE_AFTER_SECONDS", 300.0, minimum=1.0),
            shutdown_timeout=env_float(env, "SHUTDOWN_TIMEOUT_SECONDS", 30.0, minimum=0.0),
            boot_timeout=env_float(env, "WORKER_BOOT_TIMEOUT_SECONDS", 60.0, minimum=0.0),
            metrics_port=env_int(env, "WORKER_METRICS_PORT", 9100, minimum=0, maximum=65535),
            metrics_host=env_str(env, "WORKER_METRICS_HOST", "0.0.0.0"),  # noqa: S104
            prometheus_multiproc_dir=Path(multiproc) if multiproc else None,
            retention_days=env_float(env, "TASK_RETENTION_DAYS", 7.0, minimum=0.0),
            log_level=log_level,
            log_format=log_format,
            notify_channel=env_str(env, "NOTIFY_CHANNEL", "fairq_tasks"),
            handler_config=handler_config_from_env(env),
        )


def handler_config_from_env(env: Mapping[str, str]) -> HandlerConfig:
    """The handlers' settings (`SMTP_URL`, `SMTP_FROM`, `WEBHOOK_*`) from `env`.

    Shared by the worker and the API, whose `POST /workers/process` runs the same handlers:
    both must honour the same variables. Raises `SettingsError` naming the variable.
    """
    return HandlerConfig(
        smtp_url=env_str(env, "SMTP_URL", "smtp://127.0.0.1:1025"),
        smtp_from=env_str(env, "SMTP_FROM", "fairq@localhost"),
        webhook_allow_private=env_bool(env, "WEBHOOK_ALLOW_PRIVATE", False),
        webhook_timeout=env_float(env, "WEBHOOK_TIMEOUT_SECONDS", 10.0, minimum=0.1, maximum=300),
    )
