"""`python -m worker`: run the supervisor, or one processing pass with `--once` (design §5).

Flags mirror settings: each one overrides its environment variable and is validated the
same way (`WorkerSettings.from_env`). Exit statuses: 0 stopped on request; 1 cannot start
(metrics port taken, database error in `--once`); 2 invalid configuration (the message names
the variable); 3 children could not boot; 4 in `--once` a handler overran its task's deadline
(`processing.timeouts`: that task timed out, the rest of its batch was handed back).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from sqlalchemy.exc import DBAPIError

from common import logging as fairq_logging
from common.environment import SettingsError
from worker.settings import WorkerSettings

if TYPE_CHECKING:
    import psycopg
    from psycopg_pool import ConnectionPool

    from worker import processing

SETTINGS_ERROR_EXIT = 2
# In `--once` a handler overran its task's deadline (`worker.child.HANDLER_STUCK` in a child).
HANDLER_STUCK_EXIT = 4


@dataclass(frozen=True)
class _Flag:
    flag: str
    variable: str
    default: object  # the `WorkerSettings` field's default, for --help
    metavar: str
    help: str


# Each flag and the variable it overrides; --help shows both, and the variable's default.
FLAGS = (
    _Flag(
        "--concurrency", "WORKER_CONCURRENCY", WorkerSettings.concurrency, "N",
        "worker children to keep running (1..WORKER_MAX_CONCURRENCY)",
    ),
    _Flag(
        "--batch-size", "WORKER_BATCH_SIZE", WorkerSettings.batch_size, "N",
        "tasks claimed per batch (1..10000)",
    ),
    _Flag(
        "--threads", "WORKER_THREADS", WorkerSettings.threads, "N",
        "handlers a child runs at once, its batch's tasks in claim order, a thread each (1..256)",
    ),
    _Flag(
        "--poll-interval", "WORKER_POLL_INTERVAL", WorkerSettings.poll_interval, "SECONDS",
        "how long an idle child waits for a NOTIFY before polling (0.01..3600)",
    ),
    _Flag(
        "--metrics-port", "WORKER_METRICS_PORT", WorkerSettings.metrics_port, "PORT",
        "port of the supervisor's /metrics and /health (0: any free port)",
    ),
)  # fmt: skip

EPILOG = """\
Other settings come from the environment only: DATABASE_URL (required), DATABASE_POOL_MODE,
LISTEN_DATABASE_URL, STALE_AFTER_SECONDS,
SHUTDOWN_TIMEOUT_SECONDS, WORKER_MAX_CONCURRENCY, WORKER_BOOT_TIMEOUT_SECONDS,
WORKER_CHILD_TIMEOUT_SECONDS, WORKER_METRICS_HOST, PROMETHEUS_MULTIPROC_DIR,
TASK_RETENTION_DAYS, NOTIFY_CHANNEL, SMTP_URL, SMTP_FROM, WEBHOOK_ALLOW_PRIVATE,
WEBHOOK_TIMEOUT_SECONDS, LOG_LEVEL, LOG_FORMAT.

Signals to the supervisor: TERM/INT graceful stop; QUIT stop within a second; TTIN/TTOU one
child more/fewer (at most WORKER_MAX_CONCURRENCY); HUP rolling restart of the children.
Exit status: 0 stopped; 1 cannot start (e.g. metrics port taken); 2 invalid configuration;
3 children could not boot and none was working."""


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser; every setting flag names its environment variable."""
    parser = argparse.ArgumentParser(
        prog="python -m worker",
        description="fairq worker supervisor: forks children that claim and run tasks.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for flag in FLAGS:
        parser.add_argument(
            flag.flag,
            metavar=flag.metavar,
            dest=flag.variable,
            help=f"{flag.help}; env {flag.variable}, default {flag.default}",
        )
    parser.add_argument(
        "--once",
        action="store_true",
        help="run one processing pass in this process (no fork), print its counts as JSON and exit",
    )
    parser.add_argument(
        "--metrics-port-file",
        metavar="PATH",
        type=Path,
        help="write the metrics port to PATH once listening (useful with --metrics-port 0)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv`, read settings, run; return the exit status."""
    args = build_parser().parse_args(argv)
    overrides = {
        flag.variable: getattr(args, flag.variable)
        for flag in FLAGS
        if getattr(args, flag.variable) is not None
    }
    try:
        settings = WorkerSettings.from_env(overrides=overrides)
    except SettingsError as exc:
        given = [
            f.flag for f in FLAGS if f.variable in overrides and str(exc).startswith(f.variable)
        ]
        source = f" (given as {given[0]})" if given else ""
        print(f"fairq worker: invalid configuration: {exc}{source}", file=sys.stderr)
        return SETTINGS_ERROR_EXIT
    fairq_logging.configure(settings.log_level, settings.log_format)
    if args.once:
        return run_once(settings)
    from worker import supervisor  # noqa: PLC0415  (keeps --once free of the fork machinery)

    try:
        return supervisor.Supervisor(settings, metrics_port_file=args.metrics_port_file).run()
    except supervisor.SupervisorError as exc:
        print(f"fairq worker: cannot start: {exc}", file=sys.stderr)
        return 1


def run_once(settings: WorkerSettings) -> int:
    """One processing pass in this process; print `{claimed, completed, ...}` as one line."""
    from db import connector  # noqa: PLC0415
    from worker import processing  # noqa: PLC0415

    # TERM or INT (a Job's deadline, `timeout`, Ctrl-C) stops the pass as in a child: the
    # tasks in hand finish, the rest is handed back instead of stranded in `processing`.
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda _signum, _frame: stop.set())
    pool = connector.make_pool(
        settings.database_url,
        application_name="fairq-worker-once",
        statement_timeout_ms=processing.WORKER_STATEMENT_TIMEOUT_MS,
        transaction_pooling=settings.transaction_pooling,
        min_size=1,
        max_size=1,
    )
    unwritten = processing.UnwrittenOutcomes()
    try:
        result = processing.run_pass(
            pool,
            worker_id=f"{socket.gethostname()}:{os.getpid()}",
            settings=settings,
            stop=stop.is_set,
            unwritten=unwritten,
            on_overrun=_exit_overrun,
        )
    except DBAPIError as exc:
        print(f"fairq worker: database error: {exc.orig or exc}", file=sys.stderr)
        _write_unwritten(pool, unwritten)
        return 1
    finally:
        pool.close()
    print(json.dumps(dataclasses.asdict(result)), flush=True)
    return 0


def _exit_overrun(overrun: processing.Overrun) -> NoReturn:
    """Exit `HANDLER_STUCK_EXIT`: a thread of ours is in a handler that overran its deadline.

    Called from the pass's lease keeper thread once the pass wrote what it owed.
    """
    print(
        f"fairq worker: task {overrun.task.id} (type {overrun.task.type}) was still running "
        f"{overrun.ran:.1f}s after it started, past its timeout of {overrun.timeout:g}s and "
        "the grace; it timed out, the rest of the batch was handed back",
        file=sys.stderr,
        flush=True,
    )
    fairq_logging.flush()
    os._exit(HANDLER_STUCK_EXIT)


def _write_unwritten(
    pool: ConnectionPool[psycopg.Connection[Any]], unwritten: processing.UnwrittenOutcomes
) -> None:
    """Try once more to write what the failed pass left; say on stderr what stays unwritten."""
    from worker import processing  # noqa: PLC0415

    if not unwritten:
        return
    with contextlib.suppress(DBAPIError):
        processing.write_unwritten(pool, unwritten)
    if unwritten:
        print(
            f"fairq worker: {unwritten.completions} completions and {unwritten.releases} "
            "releases not written; those tasks run again once their leases expire "
            "(STALE_AFTER_SECONDS)",
            file=sys.stderr,
        )
