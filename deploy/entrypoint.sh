#!/bin/sh
# Entrypoint of the fairq image (API, worker supervisor and migrations).
#
# It passes the environment on untouched, PROMETHEUS_MULTIPROC_DIR included (the image and
# compose set it): set before the process starts, it is in place before anything imports
# prometheus_client. The processes that write metrics create and empty that directory
# themselves (common/metrics_dir.py). Then exec the command, so it replaces this shell as
# PID 1 and receives the SIGTERM of `docker stop` itself.
set -eu

if [ "$#" -eq 0 ]; then
    echo "entrypoint: no command given" >&2
    exit 64
fi

exec "$@"
