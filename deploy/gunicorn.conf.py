"""gunicorn settings for the fairq API (`gunicorn -c deploy/gunicorn.conf.py wsgi:app`).

Every value can be overridden from the environment (GUNICORN_BIND, GUNICORN_WORKERS,
GUNICORN_ACCESSLOG, ...).
"""

from __future__ import annotations

import os
import shutil
import tempfile

# Multiprocess metrics need a directory shared by every gunicorn worker, set before any of
# them imports prometheus_client (docs/stack-notes.md); without one, /metrics would show whichever
# worker answered. The entrypoint or the operator may choose it; else a fresh one per run,
# created only then (not as setdefault's argument, which ran on every start and left an
# empty directory behind) and removed when the master exits.
_OWN_METRICS_DIR: str | None = None
if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    _OWN_METRICS_DIR = tempfile.mkdtemp(prefix="fairq-api-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = _OWN_METRICS_DIR

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
    """Empty the metrics directory before any worker writes to it.

    Counters would otherwise carry over from the previous run (docs/stack-notes.md). Only the master
    runs this, before forking; `prometheus_client` is not imported here on purpose.
    """
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not directory:
        return
    os.makedirs(directory, exist_ok=True)
    for name in os.listdir(directory):
        if name.endswith(".db"):
            os.remove(os.path.join(directory, name))


def on_exit(server: object) -> None:
    """Remove the metrics directory this file created (an operator's stays)."""
    if _OWN_METRICS_DIR is not None:
        shutil.rmtree(_OWN_METRICS_DIR, ignore_errors=True)


def child_exit(server: object, worker: object) -> None:
    """Drop a dead worker's live gauges from the aggregated view."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # Imported lazily: the variable must be set before prometheus_client is first imported.
        from prometheus_client import multiprocess  # noqa: PLC0415

        multiprocess.mark_process_dead(worker.pid)  # type: ignore[attr-defined,no-untyped-call]
