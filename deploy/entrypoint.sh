#!/bin/sh
# Entrypoint of the fairq image (API, worker supervisor and migrations).
#
# PROMETHEUS_MULTIPROC_DIR must exist, and hold no files from a previous run, before the
# process imports prometheus_client: stale *.db files would carry counters over a restart
# (docs/stack-notes.md). Then exec the command, so it replaces this shell as PID 1 and receives the
# SIGTERM of `docker stop` itself.
set -eu

if [ -n "${PROMETHEUS_MULTIPROC_DIR:-}" ]; then
    mkdir -p -- "$PROMETHEUS_MULTIPROC_DIR"
    # An unmatched glob stays literal; rm -f ignores it.
    rm -f -- "$PROMETHEUS_MULTIPROC_DIR"/*.db
fi

if [ "$#" -eq 0 ]; then
    echo "entrypoint: no command given" >&2
    exit 64
fi

exec "$@"
