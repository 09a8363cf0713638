"""Worker settings: the only place worker processes read the environment (design §8).

Each default is written once, on its dataclass field below (or, for a variable the API reads
too, in `common.environment`); `from_env`, the command line's help and `PassSettings()` all
read it from there.
"""

from __future__ import annotations

import os
from collections import ChainMap
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from common.environment import (
    DEFAULT_LOG_FORMAT,
    DEFAULT_LOG_LEVEL,
    DEFAULT_NOTIFY_CHANNEL,
    DEFAULT_POOL_MODE,
    DEFAULT_STALE_AFTER_SECONDS,
    SettingsError,
    env_float,
    env_int,
    env_logging,
    env_notify_channel,
    env_optional_url,
    env_pool_mode,
    env_stale_after,
    env_str,
    env_url,
)
from worker.tasktypes.base import HandlerConfig

# The most children one supervisor may be allowed (`WORKER_MAX_CONCURRENCY`).
MAX_CHILDREN = 256
# The most handlers one child may run at once (`WORKER_THREADS`): a thread each, all sharing
# one interpreter lock and one database connection.
MAX_THREADS = 256


@dataclass(frozen=True)
class PassSettings:
    """What one processing pass needs to know (`worker.processing`), with the worker's defaults.

    A worker child passes its `WorkerSettings` (which extend these); `POST /workers/process`
    and tests build one. Durations are seconds.
    """

    batch_size: int = 100
    stale_after: float = DEFAULT_STALE_AFTER_SECONDS
    heartbeat_interval: float | None = None
    handler_config: HandlerConfig = field(default_factory=HandlerConfig)
    # How many of its batch's handlers a pass runs at once, each on a thread of its own
    # (`WORKER_THREADS`; docs/decisions/0003, "Threads in a child").
    threads: int = 1

    @property
    def effective_heartbeat_interval(self) -> float:
        """Seconds between worker heartbeats: `heartbeat_interval`, else a fifth of `stale_after`.

        A fifth leaves four missed beats before the worker's leases may be taken over
        (design §4, "Dead workers' leases").
        """
        return self.heartbeat_interval or self.stale_after / 5


@dataclass(frozen=True, kw_only=True)
class WorkerSettings(PassSettings):
    """Settings of the worker supervisor and its children, validated at start.

    The pass's settings (`PassSettings`) plus the supervisor's and the children's loop's.
    Durations are seconds.
    """

    database_url: str
    database_pool_mode: str = DEFAULT_POOL_MODE
    listen_database_url: str | None = None
    concurrency: int = 2
    # The most children SIGTTIN may bring; each holds two connections (README, "The worker
    # supervisor": sizing max_connections).
    max_concurrency: int = 32
    poll_interval: float = 1.0
    shutdown_timeout: float = 30.0
    boot_timeout: float = 60.0
    # A child silent this long is killed and replaced (design §5, "Hung children").
    child_timeout: float = 60.0
    metrics_port: int = 9100
    metrics_host: str = "0.0.0.0"  # noqa: S104  (metrics are scraped from other hosts)
    prometheus_multiproc_dir: Path | None = None
    retention_days: float = 7.0
    log_level: str = DEFAULT_LOG_LEVEL
    log_format: str = DEFAULT_LOG_FORMAT
    notify_channel: str = DEFAULT_NOTIFY_CHANNEL

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
        max_concurrency = env_int(
            env, "WORKER_MAX_CONCURRENCY", cls.max_concurrency, minimum=1, maximum=MAX_CHILDREN
        )
        concurrency = env_int(
            env, "WORKER_CONCURRENCY", cls.concurrency, minimum=1, maximum=MAX_CHILDREN
        )
        if concurrency > max_concurrency:
            raise SettingsError(
                f"WORKER_CONCURRENCY ({concurrency}) is above WORKER_MAX_CONCURRENCY "
                f"({max_concurrency}): raise WORKER_MAX_CONCURRENCY, and the database's "
                "max_connections with it (two connections per child)"
            )
        # A field's class attribute is its default (`dataclasses`): each is written once.
        return cls(
            database_url=env_url(env),
            database_pool_mode=env_pool_mode(env),
            listen_database_url=env_optional_url(env, "LISTEN_DATABASE_URL"),
            concurrency=concurrency,
            max_concurrency=max_concurrency,
            batch_size=env_int(env, "WORKER_BATCH_SIZE", cls.batch_size, minimum=1, maximum=10_000),
            threads=env_int(env, "WORKER_THREADS", cls.threads, minimum=1, maximum=MAX_THREADS),
            poll_interval=env_float(
                env, "WORKER_POLL_INTERVAL", cls.poll_interval, minimum=0.01, maximum=3600
            ),
            stale_after=env_stale_after(env),
            shutdown_timeout=env_float(
                env, "SHUTDOWN_TIMEOUT_SECONDS", cls.shutdown_timeout, minimum=0.0
            ),
            boot_timeout=env_float(
                env, "WORKER_BOOT_TIMEOUT_SECONDS", cls.boot_timeout, minimum=0.0
            ),
            child_timeout=env_float(
                env, "WORKER_CHILD_TIMEOUT_SECONDS", cls.child_timeout, minimum=1.0
            ),
            metrics_port=env_int(
                env, "WORKER_METRICS_PORT", cls.metrics_port, minimum=0, maximum=65535
            ),
            metrics_host=env_str(env, "WORKER_METRICS_HOST", cls.metrics_host),
            prometheus_multiproc_dir=Path(multiproc) if multiproc else None,
            retention_days=env_float(env, "TASK_RETENTION_DAYS", cls.retention_days, minimum=0.0),
            log_level=log_level,
            log_format=log_format,
            notify_channel=env_notify_channel(env),
            handler_config=HandlerConfig.from_env(env),
        )

    @property
    def transaction_pooling(self) -> bool:
        """`DATABASE_URL` goes through a transaction pooler (`DATABASE_POOL_MODE=transaction`)."""
        return self.database_pool_mode == "transaction"

    @property
    def listen_url(self) -> str | None:
        """Where a child LISTENs for wake-ups, or None to poll only.

        LISTEN needs a server session of its own, which a transaction pooler does not keep:
        behind one, only `LISTEN_DATABASE_URL` (a direct or session-pooled URL) is used.
        """
        if self.listen_database_url is not None:
            return self.listen_database_url
        return None if self.transaction_pooling else self.database_url
