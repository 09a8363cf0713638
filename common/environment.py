"""Environment variables: the parsers both settings modules use, and the variables both read.

`worker.settings` and `api.settings` are built on this module, so every variable is validated
the same way and every error names its variable. A variable both process kinds read
(`DATABASE_URL`, `DATABASE_POOL_MODE`, `LOG_LEVEL`, `LOG_FORMAT`, `STALE_AFTER_SECONDS`,
`NOTIFY_CHANNEL`) is parsed here, with its one default; the handlers' `SMTP_*` and
`WEBHOOK_*` by `worker.tasktypes.HandlerConfig.from_env` with these parsers.

In `common`, below both (layers api -> worker -> common -> db): it imports nothing of ours.
"""

from __future__ import annotations

from collections.abc import Mapping


class SettingsError(ValueError):
    """A configuration variable is missing or invalid; the message names the variable."""


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMATS = ("text", "json")

DEFAULT_LOG_LEVEL = "INFO"
DEFAULT_LOG_FORMAT = "text"
# Two minutes: a dead worker's leases go back this long after its last heartbeat, and a live
# one beats every fifth of it (one row per worker). Above the supervisor's hung-child
# timeout (60 s), which must kill a frozen child before its leases go (decision 0013).
DEFAULT_STALE_AFTER_SECONDS = 120.0
DEFAULT_NOTIFY_CHANNEL = "fairq_tasks"
# PgBouncer's names for what one client connection may rely on: a server session of its own
# ("session", also a direct connection) or one only for the length of a transaction.
POOL_MODES = ("session", "transaction")
DEFAULT_POOL_MODE = "session"


# -- parsers --------------------------------------------------------------------------------


def env_str(env: Mapping[str, str], name: str, default: str) -> str:
    """`env[name]` stripped, or `default` when unset or blank."""
    value = env.get(name, "").strip()
    return value or default


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


# -- the variables both process kinds read ----------------------------------------------------


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


def env_optional_url(env: Mapping[str, str], name: str) -> str | None:
    """Like `env_url`, but None when the variable is unset or empty."""
    return env_url(env, name) if env.get(name, "").strip() else None


def env_pool_mode(env: Mapping[str, str]) -> str:
    """`DATABASE_POOL_MODE`: `transaction` when `DATABASE_URL` goes through a transaction pooler.

    Connections then prepare no statements and send no startup options (design §8).
    """
    mode = env_str(env, "DATABASE_POOL_MODE", DEFAULT_POOL_MODE).lower()
    if mode not in POOL_MODES:
        raise SettingsError(f"DATABASE_POOL_MODE must be one of {', '.join(POOL_MODES)}")
    return mode


def env_logging(env: Mapping[str, str]) -> tuple[str, str]:
    """`LOG_LEVEL` (one of `LOG_LEVELS`) and `LOG_FORMAT` (text or json), validated."""
    log_level = env_str(env, "LOG_LEVEL", DEFAULT_LOG_LEVEL).upper()
    if log_level not in LOG_LEVELS:
        raise SettingsError(f"LOG_LEVEL must be one of {', '.join(LOG_LEVELS)}")
    log_format = env_str(env, "LOG_FORMAT", DEFAULT_LOG_FORMAT).lower()
    if log_format not in LOG_FORMATS:
        raise SettingsError("LOG_FORMAT must be text or json")
    return log_level, log_format


def env_stale_after(env: Mapping[str, str]) -> float:
    """`STALE_AFTER_SECONDS`: a lease not refreshed for this long may be taken over."""
    return env_float(env, "STALE_AFTER_SECONDS", DEFAULT_STALE_AFTER_SECONDS, minimum=1.0)


def env_notify_channel(env: Mapping[str, str]) -> str:
    """`NOTIFY_CHANNEL`: the PostgreSQL channel that wakes idle workers."""
    return env_str(env, "NOTIFY_CHANNEL", DEFAULT_NOTIFY_CHANNEL)
