"""Entrypoint of the PgBouncer stand-in: pgbouncer.ini from the environment, then exec.

The variables of edoburu/pgbouncer's entrypoint, written the same way: `DATABASE_URL` gives
the `[databases]` entry (`<name> = host=... port=... auth_user=<user>`) and the user's line
in `userlist.txt` (the password itself for `AUTH_TYPE` plain or scram-sha-256, else its md5);
`LISTEN_ADDR` (default 0.0.0.0) and `LISTEN_PORT` (default 5432); every other setting named
in `SETTINGS` is written when its variable (the upper-case name) is set. Standard library
only: it runs on the stand-in base's Python.
"""

from __future__ import annotations

import hashlib
import os
import sys
import urllib.parse
from pathlib import Path

CONFIG_DIR = Path("/etc/pgbouncer")
SETTINGS = (
    "auth_hba_file", "auth_user", "auth_query", "auth_dbname", "pool_mode", "max_client_conn",
    "pool_size", "default_pool_size", "min_pool_size", "reserve_pool_size",
    "reserve_pool_timeout", "max_db_connections", "max_user_connections", "server_round_robin",
    "disable_pqexec", "application_name_add_host", "timezone", "max_prepared_statements",
    "log_connections", "log_disconnections", "log_pooler_errors", "log_stats", "stats_period",
    "verbose", "stats_users", "logfile", "server_reset_query", "server_reset_query_always",
    "server_check_delay", "server_check_query", "server_lifetime", "server_idle_timeout",
    "server_connect_timeout", "server_login_retry", "client_login_timeout",
    "autodb_idle_timeout", "dns_max_ttl", "dns_nxdomain_ttl", "query_timeout",
    "query_wait_timeout", "client_idle_timeout", "idle_transaction_timeout", "pkt_buf",
    "max_packet_size", "listen_backlog", "sbuf_loopcnt", "suspend_timeout", "tcp_defer_accept",
    "tcp_keepalive", "tcp_keepcnt", "tcp_keepidle", "tcp_keepintvl", "tcp_user_timeout",
)  # fmt: skip


def main() -> None:
    """Write the configuration unless it exists, then exec the command."""
    env = os.environ
    config = CONFIG_DIR / "pgbouncer.ini"
    auth_file = Path(env.get("AUTH_FILE", str(CONFIG_DIR / "userlist.txt")))
    auth_type = env.get("AUTH_TYPE", "md5")
    url = urllib.parse.urlsplit(env.get("DATABASE_URL", ""))
    user = urllib.parse.unquote(url.username or "")
    password = urllib.parse.unquote(url.password or "")
    if user and password:
        secret = password
        if auth_type not in {"plain", "scram-sha-256"}:
            secret = "md5" + hashlib.md5((password + user).encode()).hexdigest()
        auth_file.write_text(f'"{user}" "{secret}"\n')
    lines = [
        "[databases]",
        f"{url.path.lstrip('/') or '*'} = host={url.hostname} port={url.port or 5432}"
        f" auth_user={user or 'postgres'}",
        "[pgbouncer]",
        f"listen_addr = {env.get('LISTEN_ADDR', '0.0.0.0')}",
        f"listen_port = {env.get('LISTEN_PORT', '5432')}",
        "unix_socket_dir =",
        "user = postgres",
        f"auth_file = {auth_file}",
        f"auth_type = {auth_type}",
        f"ignore_startup_parameters = {env.get('IGNORE_STARTUP_PARAMETERS', 'extra_float_digits')}",
        f"admin_users = {env.get('ADMIN_USERS', 'postgres')}",
    ]
    lines += [f"{name} = {env[name.upper()]}" for name in SETTINGS if env.get(name.upper())]
    if not config.exists():
        config.write_text("\n".join(lines) + "\n")
    os.execvp(sys.argv[1], sys.argv[1:])


if __name__ == "__main__":
    main()
