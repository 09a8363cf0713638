"""Log setup of the worker processes: one line per record, as text or JSON (`LOG_FORMAT`).

The supervisor configures logging once before forking; children inherit the handler and
every line carries the pid, so interleaved output of the process tree stays attributable.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import sys
from typing import Any

TEXT_FORMAT = "%(asctime)s %(levelname)s [%(process)d] %(name)s: %(message)s"

# Attributes every LogRecord has; anything else was passed with `extra=` and is logged too.
_RECORD_ATTRIBUTES = frozenset(
    vars(logging.LogRecord("x", logging.INFO, "x", 0, "x", None, None)).keys()
) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """Format a record as one JSON object: time (UTC, ISO 8601), level, logger, pid, message."""

    def format(self, record: logging.LogRecord) -> str:
        """Render `record` as a single line of JSON, with the traceback if there is one."""
        entry: dict[str, Any] = {
            "time": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
        }
        entry.update(
            (key, value) for key, value in vars(record).items() if key not in _RECORD_ATTRIBUTES
        )
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure(level: str = "INFO", fmt: str = "text") -> None:
    """Send every log record of the process to stderr at `level`, as `fmt` (text or json).

    Replaces handlers already on the root logger, so calling it twice does not log twice.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)


def flush() -> None:
    """Flush the root handlers (before `os._exit`, which skips interpreter cleanup)."""
    for handler in logging.getLogger().handlers:
        handler.flush()
