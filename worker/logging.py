"""Log setup of fairq processes: one line per record, as text or JSON (`LOG_FORMAT`).

The supervisor configures logging once before forking; children inherit the handler and
every line carries the pid, so interleaved output of the process tree stays attributable.
The API (`api.logging`) installs the same handler and formatters on its `fairq` logger.

Throughput: a processing pass logs one line per task, which at first cost a busy child about
15 us of CPU per task (a noop task costs about 35 us in all): building the record (its caller's
file and line included), formatting the time, and one `write` per line. So a worker process's
records skip the caller lookup (`configure`), the formatters compute the date once per second,
and inside `batched()` (every processing pass runs in one) the handler keeps records and
writes them as one block: when the pass ends, when `BUFFER_CAPACITY` records wait, when the
oldest has waited `MAX_HOLD_SECONDS` (checked as records arrive and by `write_due()`, which
the pass's lease keeper calls every tick, so slow tasks do not hold lines back), or at once
when a WARNING or worse (or a record with a traceback) arrives, after everything held before
it. Outside `batched()` every record is written when it is logged. A process that dies by SIGKILL
loses at most its last `MAX_HOLD_SECONDS` of INFO lines; its warnings were already written.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import sys
import time
import weakref
from collections.abc import Iterator
from typing import Any, TextIO

TEXT_FORMAT = "%(asctime)s %(levelname)s [%(process)d] %(name)s: %(message)s"
# Records held inside `batched()` before they are written anyway (about one batch of tasks).
BUFFER_CAPACITY = 500
# The longest a held line waits (plus one lease keeper tick) before it is written.
MAX_HOLD_SECONDS = 0.5
FORMATS = ("text", "json")

# One encoder for every line: `json.dumps(..., default=str)` would build one per call.
_encode_json = json.JSONEncoder(default=str).encode

# Attributes every LogRecord has; anything else was passed with `extra=` and is logged too.
_RECORD_ATTRIBUTES = frozenset(
    vars(logging.LogRecord("x", logging.INFO, "x", 0, "x", None, None)).keys()
) | {"message", "asctime", "taskName"}


class TextFormatter(logging.Formatter):
    """`TEXT_FORMAT`, with the date part of `asctime` computed once per second, not per line."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)
        self._second: tuple[int, str] = (-1, "")

    def format(self, record: logging.LogRecord) -> str:
        """`TEXT_FORMAT` filled in directly; `logging.Formatter`'s way for a traceback."""
        if record.exc_info or record.exc_text or record.stack_info:
            return super().format(record)
        record.message = record.getMessage()
        record.asctime = self.formatTime(record)
        return f"{record.asctime} {record.levelname} [{record.process}] {record.name}: " + (
            record.message
        )

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        """Local time as `YYYY-MM-DD HH:MM:SS,mmm`, like `logging.Formatter`'s default."""
        second = int(record.created)
        cached_second, prefix = self._second
        if second != cached_second:
            prefix = time.strftime("%Y-%m-%d %H:%M:%S", self.converter(record.created))
            self._second = (second, prefix)  # one assignment: a reader never sees half of it
        return f"{prefix},{int(record.msecs):03d}"


class JsonFormatter(logging.Formatter):
    """Format a record as one JSON object: time (UTC, ISO 8601), level, logger, pid, message.

    Fields passed with `extra=` (`task_id`, `duration_ms`, ...) become keys of the object;
    values JSON cannot represent (UUIDs) are written as strings.
    """

    def __init__(self) -> None:
        super().__init__()
        self._second: tuple[int, str] = (-1, "")

    def _time(self, created: float) -> str:
        second = int(created)
        cached_second, prefix = self._second
        if second != cached_second:
            prefix = dt.datetime.fromtimestamp(second, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S")
            self._second = (second, prefix)
        millis = min(int((created - second) * 1000), 999)
        return f"{prefix}.{millis:03d}+00:00"

    def format(self, record: logging.LogRecord) -> str:
        """Render `record` as a single line of JSON, with the traceback if there is one."""
        entry: dict[str, Any] = {
            "time": self._time(record.created),
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():  # a plain loop: cheaper than a generator
            if key not in _RECORD_ATTRIBUTES:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return _encode_json(entry)


def make_formatter(fmt: str) -> logging.Formatter:
    """The formatter for `LOG_FORMAT` `fmt` (`text` or `json`)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown log format {fmt!r} (expected one of {FORMATS})")
    return JsonFormatter() if fmt == "json" else TextFormatter()


class LineHandler(logging.Handler):
    """Write each record as one line to `stream` (default: `sys.stderr` at write time).

    Inside `batched()` records are held and written together (see the module docstring).
    Looking `sys.stderr` up at write time keeps the handler valid when something replaces
    it (pytest's capture, a test's `capsys`).
    """

    def __init__(
        self,
        fmt: str = "text",
        stream: TextIO | None = None,
        *,
        capacity: int = BUFFER_CAPACITY,
        flush_level: int = logging.WARNING,
    ) -> None:
        super().__init__()
        self.setFormatter(make_formatter(fmt))
        self._stream = stream
        self.capacity = capacity
        self.flush_level = flush_level
        self._held: list[logging.LogRecord] = []
        self._held_since = 0.0  # time.monotonic() of the oldest held record
        self._depth = 0  # open `batched()` scopes; guarded by the handler lock
        _HANDLERS.add(self)

    @property
    def stream(self) -> TextIO:
        """Where lines go."""
        return self._stream if self._stream is not None else sys.stderr

    def emit(self, record: logging.LogRecord) -> None:
        """Write `record` now, or hold it while a `batched()` scope is open.

        Runs with the handler lock held (`logging.Handler.handle`).
        """
        if self._depth == 0:
            self._write([record])
            return
        if not self._held:
            self._held_since = time.monotonic()
        self._held.append(record)
        if (
            len(self._held) >= self.capacity
            or time.monotonic() - self._held_since >= MAX_HOLD_SECONDS
            or record.levelno >= self.flush_level
            or record.exc_info  # do not keep a traceback's frames alive until the pass ends
        ):
            self._write_held()

    def flush(self) -> None:
        """Write every held record, then flush the stream."""
        self.acquire()
        try:
            self._write_held()
            # A closed stream must not break the caller (flush() runs right before os._exit).
            with contextlib.suppress(OSError, ValueError):
                self.stream.flush()
        finally:
            self.release()

    def open_batch(self) -> None:
        """Start holding records (scopes nest)."""
        self.acquire()
        try:
            self._depth += 1
        finally:
            self.release()

    def close_batch(self) -> None:
        """End one scope; when the last one ends, write what is held."""
        self.acquire()
        try:
            self._depth = max(self._depth - 1, 0)
            if self._depth == 0:
                self._write_held()
        finally:
            self.release()

    def write_due(self, now: float) -> None:
        """Write what is held if the oldest record has waited `MAX_HOLD_SECONDS` by `now`."""
        self.acquire()
        try:
            if self._held and now - self._held_since >= MAX_HOLD_SECONDS:
                self._write_held()
        finally:
            self.release()

    def forget_after_fork(self) -> None:
        """In a forked child: drop the parent's held records (the parent writes them)."""
        self._held = []
        self._depth = 0

    def _write_held(self) -> None:
        if self._held:
            held, self._held = self._held, []
            self._write(held)

    def _write(self, records: list[logging.LogRecord]) -> None:
        lines: list[str] = []
        for record in records:
            try:
                lines.append(self.format(record))
            except RecursionError:  # as logging.StreamHandler does (bpo-36272)
                raise
            except Exception:
                self.handleError(record)
        if not lines:
            return
        try:
            stream = self.stream
            stream.write("\n".join(lines) + "\n")  # one write for the whole block
            stream.flush()
        except RecursionError:
            raise
        except Exception:
            self.handleError(records[-1])


_HANDLERS: weakref.WeakSet[LineHandler] = weakref.WeakSet()


def _forget_held_after_fork() -> None:
    for handler in list(_HANDLERS):
        handler.forget_after_fork()


os.register_at_fork(after_in_child=_forget_held_after_fork)


def configure(level: str = "INFO", fmt: str = "text", *, logger: str = "") -> LineHandler:
    """Send every record of `logger` (default: the root, i.e. all) to stderr at `level`.

    `fmt` is `text` or `json`. Replaces the handlers already on that logger, so calling it
    twice does not log twice. Returns the handler.

    For the root logger (a worker process, whose logging is all ours) records also skip
    looking up their caller's file, line and thread (the Logging HOWTO's "Optimization"
    switches): neither format shows them, and a busy child logs a line per task.
    """
    if not logger:
        logging._srcfile = None
        logging.logThreads = False
        logging.logMultiprocessing = False
        if sys.version_info >= (3, 12):
            logging.logAsyncioTasks = False
    handler = LineHandler(fmt)
    target = logging.getLogger(logger)
    for old in list(target.handlers):
        target.removeHandler(old)
        if isinstance(old, LineHandler):
            old.flush()
    target.addHandler(handler)
    target.setLevel(level)
    return handler


@contextlib.contextmanager
def batched() -> Iterator[None]:
    """Hold this process's log lines until the block ends, then write them in one go.

    Warnings and errors are still written at once (after the lines held before them), and
    at most `BUFFER_CAPACITY` lines wait. A processing pass runs in one such block.
    """
    handlers = list(_HANDLERS)
    for handler in handlers:
        handler.open_batch()
    try:
        yield
    finally:
        for handler in handlers:
            handler.close_batch()


def write_due() -> None:
    """Write the held lines that have waited `MAX_HOLD_SECONDS` (cheap when nothing has)."""
    now = time.monotonic()
    for handler in list(_HANDLERS):
        handler.write_due(now)


def flush() -> None:
    """Write held lines and flush every handler (before `os._exit`, which skips cleanup)."""
    for handler in {*logging.getLogger().handlers, *_HANDLERS}:
        handler.flush()
