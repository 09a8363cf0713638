"""Settings are read once from the environment and refuse bad values by name (design §8)."""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from pathlib import Path

import pytest
from flask import Flask

from api import settings as api_settings
from api.settings import ApiSettings
from common.environment import SettingsError
from worker import cli
from worker.settings import PassSettings, WorkerSettings

URL = "postgresql+psycopg://fairq@db.example/fairq"
TOKEN = "Cb-Gb1wuMmGi1EEP58eiO6U-qHk83f_qhOn8O2wSPF8"


def test_api_settings_need_database_url() -> None:
    with pytest.raises(SettingsError, match="DATABASE_URL is not set"):
        ApiSettings.from_env({"ADMIN_TOKEN": TOKEN})


@pytest.mark.parametrize("url", ["mysql://db/fairq", "sqlite:///fairq.db", "   "])
def test_api_settings_reject_a_database_url_that_is_not_postgresql(url: str) -> None:
    with pytest.raises(SettingsError, match="DATABASE_URL"):
        ApiSettings.from_env({"DATABASE_URL": url})


@pytest.mark.parametrize("scheme", ["postgresql", "postgres"])
def test_a_bare_postgresql_url_is_upgraded_to_psycopg(scheme: str) -> None:
    settings = ApiSettings.from_env({"DATABASE_URL": f"{scheme}://fairq@db.example/fairq"})

    assert settings.database_url == URL


def test_api_settings_from_a_valid_environment() -> None:
    settings = ApiSettings.from_env(
        {"DATABASE_URL": URL, "ADMIN_TOKEN": TOKEN, "STALE_AFTER_SECONDS": "60"}
    )

    assert settings.database_url == URL
    assert settings.admin_token == TOKEN
    assert settings.stale_after_seconds == 60.0


@pytest.mark.parametrize(
    ("token", "why"),
    [
        ("change-me-please-0123456789", "published placeholder"),
        ("CHANGE-ME-please-0123456789-and-some-more-text", "published placeholder"),
        ("short-token", "at least 32 characters"),
        ("x7Kq" * 7 + "x7K", "at least 32 characters"),  # 31 characters
        ("ab" * 40, "too repetitive"),
        ("0123456789" * 4, "too repetitive"),
        ("Zq9#Lm2$" * 5, "too repetitive"),
    ],
)
def test_a_guessable_admin_token_is_refused_saying_how_to_make_one(token: str, why: str) -> None:
    with pytest.raises(SettingsError, match="ADMIN_TOKEN") as refused:
        ApiSettings.from_env({"DATABASE_URL": URL, "ADMIN_TOKEN": token})

    assert why in str(refused.value)
    assert "secrets.token_urlsafe(32)" in str(refused.value)


@pytest.mark.parametrize(
    "make",
    [
        lambda: secrets.token_urlsafe(32),
        lambda: secrets.token_hex(32),
    ],
    ids=["token_urlsafe(32)", "token_hex(32)"],
)
def test_tokens_from_secrets_are_accepted(make: Callable[[], str]) -> None:
    for _ in range(200):
        token = make()
        assert ApiSettings.from_env({"DATABASE_URL": URL, "ADMIN_TOKEN": token}).admin_token


@pytest.mark.parametrize("value", [None, "", "   "], ids=["unset", "empty", "blank"])
def test_unset_or_blank_admin_token_disables_admin_endpoints(value: str | None) -> None:
    env = {"DATABASE_URL": URL} if value is None else {"DATABASE_URL": URL, "ADMIN_TOKEN": value}

    assert ApiSettings.from_env(env).admin_token is None


def test_admin_token_is_stripped_like_the_bearer_token_clients_send() -> None:
    settings = ApiSettings.from_env({"DATABASE_URL": URL, "ADMIN_TOKEN": f"  {TOKEN}\n"})

    assert settings.admin_token == TOKEN


@pytest.mark.parametrize("value", ["0", "nan", "soon"])
def test_api_settings_reject_a_bad_stale_after(value: str) -> None:
    with pytest.raises(SettingsError, match="STALE_AFTER_SECONDS"):
        ApiSettings.from_env({"DATABASE_URL": URL, "STALE_AFTER_SECONDS": value})


def test_api_settings_read_the_handler_variables_like_the_worker() -> None:
    # POST /workers/process runs the same handlers as the worker: same variables, same values.
    env = {
        "DATABASE_URL": URL,
        "SMTP_URL": "smtp://mail:1025",
        "SMTP_FROM": "queue@example.com",
        "WEBHOOK_ALLOW_PRIVATE": "true",
        "WEBHOOK_TIMEOUT_SECONDS": "3",
    }

    api = ApiSettings.from_env(env).handler_config

    assert api == WorkerSettings.from_env(env).handler_config
    assert (api.smtp_url, api.smtp_from) == ("smtp://mail:1025", "queue@example.com")
    assert (api.webhook_allow_private, api.webhook_timeout) == (True, 3.0)


def test_api_settings_reject_a_bad_handler_variable_by_name() -> None:
    with pytest.raises(SettingsError, match="WEBHOOK_ALLOW_PRIVATE"):
        ApiSettings.from_env({"DATABASE_URL": URL, "WEBHOOK_ALLOW_PRIVATE": "maybe"})


def test_worker_settings_need_database_url() -> None:
    with pytest.raises(SettingsError, match="DATABASE_URL is not set"):
        WorkerSettings.from_env({})


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("WORKER_CONCURRENCY", "0"),
        ("WORKER_CONCURRENCY", "two"),
        ("WORKER_CONCURRENCY", "1.5"),
        ("WORKER_BATCH_SIZE", "0"),
        ("WORKER_POLL_INTERVAL", "nan"),
        ("WORKER_POLL_INTERVAL", "inf"),
        ("WORKER_POLL_INTERVAL", "0"),
        ("STALE_AFTER_SECONDS", "0"),
        ("SHUTDOWN_TIMEOUT_SECONDS", "-1"),
        ("WORKER_METRICS_PORT", "65536"),
        ("TASK_RETENTION_DAYS", "nan"),
        ("WEBHOOK_ALLOW_PRIVATE", "maybe"),
        ("WEBHOOK_TIMEOUT_SECONDS", "0"),
        ("DATABASE_POOL_MODE", "statement"),
        ("LISTEN_DATABASE_URL", "mysql://host/db"),
        ("LOG_LEVEL", "LOUD"),
        ("DATABASE_URL", "mysql://db/fairq"),
    ],
)
def test_worker_settings_reject_a_bad_value_naming_the_variable(name: str, value: str) -> None:
    with pytest.raises(SettingsError, match=name) as raised:
        WorkerSettings.from_env({"DATABASE_URL": URL, name: value})

    assert str(raised.value).startswith(name)


def test_worker_settings_defaults() -> None:
    settings = WorkerSettings.from_env({"DATABASE_URL": URL})

    assert settings.database_url == URL
    assert settings.concurrency == 2
    assert settings.batch_size == 100
    assert settings.threads == 1
    assert settings.poll_interval == 1.0
    # Above the hung-child timeout: a frozen child is killed before its leases go.
    assert settings.stale_after == 120.0 > settings.child_timeout == 60.0
    assert settings.effective_heartbeat_interval == 24.0
    assert settings.shutdown_timeout == 30.0
    assert settings.metrics_port == 9100
    assert settings.retention_days == 7.0
    assert settings.handler_config.webhook_allow_private is False


def test_worker_settings_read_every_variable() -> None:
    settings = WorkerSettings.from_env(
        {
            "DATABASE_URL": URL,
            "WORKER_CONCURRENCY": "4",
            "WORKER_BATCH_SIZE": "50",
            "WORKER_THREADS": "8",
            "WORKER_POLL_INTERVAL": "0.25",
            "STALE_AFTER_SECONDS": "100",
            "SHUTDOWN_TIMEOUT_SECONDS": "5",
            "WORKER_METRICS_PORT": "9200",
            "TASK_RETENTION_DAYS": "1.5",
            "LOG_LEVEL": "debug",
            "SMTP_URL": "smtp://mail:1025",
            "WEBHOOK_ALLOW_PRIVATE": "true",
        }
    )

    assert (settings.concurrency, settings.batch_size, settings.threads) == (4, 50, 8)
    assert (settings.poll_interval, settings.stale_after) == (0.25, 100.0)
    assert settings.effective_heartbeat_interval == 20.0
    assert (settings.shutdown_timeout, settings.metrics_port) == (5.0, 9200)
    assert settings.retention_days == 1.5
    assert settings.log_level == "DEBUG"
    assert settings.handler_config.smtp_url == "smtp://mail:1025"
    assert settings.handler_config.webhook_allow_private is True


def test_the_per_company_cap_is_gone_from_settings_and_flags() -> None:
    """The claim is work-conserving: a lone company fills whole batches, nothing caps it.

    A leftover WORKER_PER_COMPANY_CAP in an old environment is not read (so it cannot stop
    a worker from starting), and `--per-company-cap` is no longer a flag.
    """
    settings = WorkerSettings.from_env({"DATABASE_URL": URL, "WORKER_PER_COMPANY_CAP": "-1"})

    assert not hasattr(settings, "per_company_cap")
    assert "WORKER_PER_COMPANY_CAP" not in {flag.variable for flag in cli.FLAGS}
    with pytest.raises(SystemExit) as exited:
        cli.build_parser().parse_args(["--per-company-cap", "10"])
    assert exited.value.code == 2


@pytest.mark.parametrize(
    ("value", "expected"),
    [("true", True), ("YES", True), ("1", True), ("off", False), ("False", False), ("", False)],
)
def test_boolean_variables_accept_the_usual_spellings(value: str, expected: bool) -> None:
    settings = WorkerSettings.from_env({"DATABASE_URL": URL, "WEBHOOK_ALLOW_PRIVATE": value})

    assert settings.handler_config.webhook_allow_private is expected


def test_worker_metrics_host_defaults_to_every_interface_and_can_be_narrowed() -> None:
    url = "postgresql+psycopg://u@h/db"

    assert WorkerSettings.from_env({"DATABASE_URL": url}).metrics_host == "0.0.0.0"
    narrowed = WorkerSettings.from_env({"DATABASE_URL": url, "WORKER_METRICS_HOST": "127.0.0.1"})
    assert narrowed.metrics_host == "127.0.0.1"


def test_the_api_and_a_pass_default_to_the_worker_values_of_the_variables_they_share() -> None:
    worker = WorkerSettings.from_env({"DATABASE_URL": URL})
    api = ApiSettings.from_env({"DATABASE_URL": URL})

    assert (api.stale_after_seconds, api.notify_channel) == (
        worker.stale_after, worker.notify_channel,
    )  # fmt: skip
    assert (api.log_level, api.log_format) == (worker.log_level, worker.log_format)
    assert api.handler_config == worker.handler_config
    assert ApiSettings(database_url=URL) == api
    assert WorkerSettings(database_url=URL) == worker
    # What a pass reads of WorkerSettings, PassSettings() holds by default.
    assert PassSettings() == PassSettings(
        worker.batch_size,
        worker.stale_after,
        worker.heartbeat_interval,
        worker.handler_config,
        worker.threads,
    )


def test_help_shows_each_flag_default_of_the_worker_settings() -> None:
    usage = " ".join(cli.build_parser().format_help().split())

    for flag in cli.FLAGS:
        assert f"env {flag.variable}, default {flag.default}" in usage
    assert "env WORKER_BATCH_SIZE, default 100" in usage


def readme_defaults() -> dict[str, str]:
    """`variable: first word of its default` from README's Configuration table."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    rows = re.findall(r"^\| `([A-Z_]+)` \| ([^|]+) \|", readme, flags=re.MULTILINE)
    return {name: cell.split()[0].strip("`") for name, cell in rows}


@pytest.mark.parametrize(
    "name",
    [
        "WORKER_CONCURRENCY", "WORKER_BATCH_SIZE", "WORKER_THREADS", "WORKER_POLL_INTERVAL",
        "STALE_AFTER_SECONDS", "SHUTDOWN_TIMEOUT_SECONDS", "WORKER_BOOT_TIMEOUT_SECONDS",
        "WORKER_METRICS_PORT", "WORKER_METRICS_HOST", "SMTP_URL", "SMTP_FROM",
        "WEBHOOK_ALLOW_PRIVATE", "WEBHOOK_TIMEOUT_SECONDS", "TASK_RETENTION_DAYS",
        "NOTIFY_CHANNEL", "LOG_LEVEL", "LOG_FORMAT",
    ],
)  # fmt: skip
def test_the_readme_states_each_default_the_settings_have(name: str) -> None:
    stated = {"DATABASE_URL": URL, name: readme_defaults()[name]}

    assert WorkerSettings.from_env(stated) == WorkerSettings.from_env({"DATABASE_URL": URL})


def test_children_listen_on_the_database_unless_it_is_a_transaction_pooler() -> None:
    direct = "postgresql+psycopg://fairq@db-host/fairq"
    pooled = {"DATABASE_URL": URL, "DATABASE_POOL_MODE": "transaction"}

    assert WorkerSettings.from_env({"DATABASE_URL": URL}).listen_url == URL
    assert WorkerSettings.from_env(pooled).listen_url is None
    assert WorkerSettings.from_env({**pooled, "LISTEN_DATABASE_URL": direct}).listen_url == direct


def test_the_app_in_context_gives_its_own_settings() -> None:
    first, second = Flask("first"), Flask("second")
    one = ApiSettings(database_url=URL, admin_token=TOKEN)
    other = ApiSettings(database_url=URL, notify_channel="elsewhere")
    api_settings.init_app(first, one)
    api_settings.init_app(second, other)

    with first.app_context():
        assert api_settings.current() is one
    with second.app_context():
        assert api_settings.current() is other
    with pytest.raises(RuntimeError, match="application context"):
        api_settings.current()
