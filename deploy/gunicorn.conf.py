"""gunicorn settings for the fairq API (`gunicorn -c deploy/gunicorn.conf.py wsgi:app`).

Every value can be overridden from the environment (GUNICORN_BIND, GUNICORN_WORKERS, ...).
"""

from __future__ import annotations

import os

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
accesslog = os.environ.get("GUNICORN_ACCESSLOG", "-")
access_log_format = '%(h)s "%(r)s" %(s)s %(b)s %(M)sms'
# gunicorn 27 opens a control socket in ~/.gunicorn by default; two instances would collide.
control_socket_disable = True
