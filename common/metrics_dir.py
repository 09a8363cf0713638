"""The Prometheus multiprocess directory (design §7): created, emptied and removed here only.

Each process tree, the API's gunicorn and the worker supervisor, keeps its metrics in one
directory, `PROMETHEUS_MULTIPROC_DIR`: every process writes its own files there and a scrape
sums them. Both call `prepare` once at start, before they fork (the supervisor in its setup,
gunicorn's master in `on_starting`): it creates the directory and removes the files of an
earlier run, which would carry counters over a restart. Without a configured directory it
makes a temporary one and exports it to the children; `remove_temporary` deletes that at
exit. The image's entrypoint only passes the variable on.

The one ordering rule left is prometheus_client's: it chooses between per-process files and
memory when it is first imported, from this variable. A variable set in the environment
before the process starts (the image, compose, `make run`) is in time whatever is imported
when; only a temporary directory is exported from Python, and `prepare` refuses to export
one after prometheus_client was imported (every child's metrics would stay in memory,
unseen). This module imports nothing of prometheus_client.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

ENV_VAR = "PROMETHEUS_MULTIPROC_DIR"

# Temporary directories `prepare` made in this process, for `remove_temporary`. Kept here,
# not by the caller: gunicorn re-reads its config file on HUP, forgetting the caller's state.
_temporary: list[Path] = []


class MetricsDirError(RuntimeError):
    """The directory cannot be used from this process; the message says why."""


def prepare(configured: Path | None, *, prefix: str) -> Path:
    """Make the metrics directory ready for a new process tree; return it.

    `configured` is created if missing and emptied of metric files (`*.db` only, in case it
    holds anything else); without one, a fresh temporary directory named `prefix...` is
    made. Either way it is exported as `PROMETHEUS_MULTIPROC_DIR`, which forked children
    inherit. Call it before forking. Raises `MetricsDirError` when the variable must change
    after prometheus_client was imported, and `OSError` when the directory cannot be made.
    """
    current = os.environ.get(ENV_VAR)
    in_place = configured is not None and bool(current) and Path(str(current)) == configured
    if not in_place and "prometheus_client" in sys.modules:
        raise MetricsDirError(
            "prometheus_client was imported before the metrics directory was set "
            f"(set {ENV_VAR} in the environment, or import it later)"
        )
    if configured is None:
        path = Path(tempfile.mkdtemp(prefix=prefix))
        _temporary.append(path)
    else:
        path = configured
        path.mkdir(parents=True, exist_ok=True)
        for entry in path.glob("*.db"):
            entry.unlink()
    os.environ[ENV_VAR] = str(path)
    return path


def remove_temporary() -> None:
    """Remove the temporary directories `prepare` made in this process; configured ones stay."""
    while _temporary:
        shutil.rmtree(_temporary.pop(), ignore_errors=True)
