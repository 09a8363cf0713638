"""gunicorn settings for the fairq API (`gunicorn -c deploy/gunicorn.conf.py wsgi:app`).

Every value can be overridden from the environment (GUNICORN_BIND, GUNICORN_WORKERS,
GUNICORN_ACCESSLOG, ...).
"""

from __future__ import annotations

import os
from pathlib import Path

# Imports nothing of prometheus_client: the master must not, before `on_starting` has set the
# metrics directory its workers inherit (common/metrics_dir.py).
from common import metrics_dir

bind = os.environ.get("GUNICORN_BIND", "0.0.0.0:8000")
workers = int(os.environ.get("GUNICORN_WORKERS", "2"))
threads = int(os.environ.get("GUNICORN_THREADS", "4"))
worker_class = "gthread"
timeout = int(os.environ.get("GUNICORN_TIMEOUT", "30"))
graceful_timeout = int(os.environ.get("GUNICORN_GRACEFUL_TIMEOUT", "30"))
keepalive = 5
# Refuse absurd request lines and headers before Flask sees them.
limit_request_line = 8190
limit_request_fields = 100
limit_request_field_size = 8190
# Off unless GUNICORN_ACCESSLOG is set (e.g. "-"): the app logs one line per request itself
# (api/logging.py, with route template, company and request id, as JSON with LOG_FORMAT=json);
# gunicorn's access line would be a second, differently formatted line per request.
accesslog = os.environ.get("GUNICORN_ACCESSLOG") or None
access_log_format = '%(h)s "%(r)s" %(s)s %(b)s %(M)sms'
# gunicorn 27 opens a control socket in ~/.gunicorn by default; two instances would collide.
control_socket_disable = True


def on_starting(server: object) -> None:
    """Prepare the workers' shared metrics directory: created, emptied, exported.

    Multiprocess metrics need one directory for every worker, else /metrics would show
    whichever worker answered (docs/stack-notes.md). The operator's `PROMETHEUS_MULTIPROC_DIR`,
    or a temporary one for this run. Only the master runs this, once, before it forks (a HUP
    re-reads this file but does not run it again, so live counters are not wiped).
    """
    configured = os.environ.get(metrics_dir.ENV_VAR)
    metrics_dir.prepare(Path(configured) if configured else None, prefix="fairq-api-metrics-")


def on_exit(server: object) -> None:
    """Remove the temporary metrics directory, if `on_starting` made one (an operator's stays)."""
    metrics_dir.remove_temporary()


def child_exit(server: object, worker: object) -> None:
    """Drop a dead worker's live gauges from the aggregated view."""
    # Imported here, not at the top: see the import of metrics_dir.
    from prometheus_client import multiprocess  # noqa: PLC0415

    multiprocess.mark_process_dead(worker.pid)  # type: ignore[attr-defined,no-untyped-call]
