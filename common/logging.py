"""Log setup of fairq processes: one line per record, as text or JSON (`LOG_FORMAT`).

The supervisor configures logging once before forking; children inherit the handler and
every line carries the pid, so interleaved output of the process tree stays attributable.
The API (`api.logging`) installs the same handler and formatters on its `fairq` logger.

Standard library handlers: a `logging.handlers.MemoryHandler` (`BatchingHandler`) in front
of a `logging.StreamHandler` on stderr (`StderrHandler`). Outside `batched()` every record is
written when it is logged. Inside (every processing pass runs in one) records are held and
written as one block: when the pass ends, when `BUFFER_CAPACITY` records wait, when the
oldest has waited `MAX_HOLD_SECONDS` (checked as records arrive and by `write_due()`, which
the pass's lease keeper calls every tick, so slow tasks do not hold lines back), or at once
when a WARNING or worse (or a record with a traceback) arrives, after everything held before
it. A process that dies by SIGKILL loses at most its last `MAX_HOLD_SECONDS` of INFO lines;
its warnings were already written.

Why: a pass logs one line per task, a large share of a noop task's CPU (decision 0003). So
the block write above, a date formatted once per second, and no caller lookup in a worker
process's loggers (`configure`), which neither format shows.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import logging.handlers
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
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

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        """UTC as `YYYY-MM-DDTHH:MM:SS.mmm+00:00`, the date part computed once per second."""
        second = int(record.created)
        cached_second, prefix = self._second
        if second != cached_second:
            prefix = dt.datetime.fromtimestamp(second, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S")
            self._second = (second, prefix)
        millis = min(int((record.created - second) * 1000), 999)
        return f"{prefix}.{millis:03d}+00:00"

    def format(self, record: logging.LogRecord) -> str:
        """Render `record` as a single line of JSON, with the traceback if there is one."""
        entry: dict[str, Any] = {
            "time": self.formatTime(record),
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


class StderrHandler(logging.StreamHandler[TextIO]):
    """A `StreamHandler` on `sys.stderr` as it is when writing (or on the stream given).

    Looking `sys.stderr` up at write time keeps the handler valid when something replaces
    it (pytest's capture, a test's `capsys`), as the standard library's last-resort handler
    does. `write_block` writes many records with one `write`.
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        # Not StreamHandler.__init__: it would bind the stream of this moment.
        logging.Handler.__init__(self)
        self._given = stream

    @property
    def stream(self) -> TextIO:
        """Where lines go."""
        return self._given if self._given is not None else sys.stderr

    @stream.setter
    def stream(self, stream: TextIO | None) -> None:
        self._given = stream

    def write_block(self, records: Sequence[logging.LogRecord]) -> None:
        """Format `records` and write them, one line each, in one `write`, then flush."""
        lines: list[str] = []
        for record in records:
            try:
                lines.append(self.format(record))
            except RecursionError:  # as StreamHandler.emit does (bpo-36272)
                raise
            except Exception:
                self.handleError(record)
        if not lines:
            return
        self.acquire()
        try:
            stream = self.stream
            stream.write(self.terminator.join(lines) + self.terminator)
            stream.flush()
        except RecursionError:
            raise
        except Exception:
            self.handleError(records[-1])
        finally:
            self.release()

    def flush(self) -> None:
        """Flush the stream; a closed one is ignored (this runs right before `os._exit`)."""
        with contextlib.suppress(OSError, ValueError):
            super().flush()


class BatchingHandler(logging.handlers.MemoryHandler):
    """A `MemoryHandler` that holds records only inside `batched()`, and writes them in blocks.

    Outside `batched()` every record is written at once. Inside, it writes what it holds
    when `capacity` records wait, on a WARNING or worse, on a record with a traceback (its
    frames are not kept alive until the pass ends), and when the oldest has waited
    `MAX_HOLD_SECONDS`. Bypasses `target`'s filters (it has none).
    """

    def __init__(self, target: StderrHandler, *, capacity: int = BUFFER_CAPACITY) -> None:
        super().__init__(capacity, flushLevel=logging.WARNING, target=target)
        self.writer = target
        self._held_since = 0.0  # time.monotonic() of the oldest held record
        _HANDLERS.add(self)

    def shouldFlush(self, record: logging.LogRecord) -> bool:
        """Tell whether to write now, with `record` just appended to the buffer."""
        if _batches.depth == 0:
            return True
        held = len(self.buffer)
        now = time.monotonic()
        if held == 1:
            self._held_since = now
        return (
            # MemoryHandler's own rule, inline: a call less per record on the hot path.
            held >= self.capacity
            or record.levelno >= self.flushLevel
            or bool(record.exc_info)
            or now - self._held_since >= MAX_HOLD_SECONDS
        )

    def flush(self) -> None:
        """Write every held record as one block, and flush the stream."""
        self.acquire()
        try:
            if not self.write_held():
                self.writer.flush()
        finally:
            self.release()

    def write_held(self, *, older_than: float | None = None) -> bool:
        """Write what is held, if anything (only if held since before `older_than`).

        Returns whether it wrote (`StderrHandler.write_block` flushes the stream too).
        """
        self.acquire()
        try:
            if not self.buffer or (older_than is not None and self._held_since > older_than):
                return False
            held, self.buffer = self.buffer, []
            self.writer.write_block(held)
            return True
        finally:
            self.release()


def make_handler(
    fmt: str = "text", stream: TextIO | None = None, *, capacity: int = BUFFER_CAPACITY
) -> BatchingHandler:
    """The handler `configure` installs: lines in format `fmt` to `stream` (default stderr)."""
    writer = StderrHandler(stream)
    writer.setFormatter(make_formatter(fmt))
    return BatchingHandler(writer, capacity=capacity)


class _Batches:
    """How many `batched()` blocks are open in this process (in any thread)."""

    def __init__(self) -> None:
        self.depth = 0
        self.lock = threading.Lock()


_batches = _Batches()
_HANDLERS: weakref.WeakSet[BatchingHandler] = weakref.WeakSet()


def _forget_held_after_fork() -> None:
    # In a forked child: the parent writes what it holds, and its blocks are not ours.
    _batches.depth = 0
    _batches.lock = threading.Lock()
    for handler in list(_HANDLERS):
        handler.buffer = []


os.register_at_fork(after_in_child=_forget_held_after_fork)


class _CallerlessLogger(logging.Logger):
    """A logger that does not look up its caller's file, line and function for each record."""

    def findCaller(
        self, stack_info: bool = False, stacklevel: int = 1
    ) -> tuple[str, int, str, str | None]:
        """Placeholders, as with `logging._srcfile = None`; the real lookup for a stack."""
        if stack_info:
            return super().findCaller(stack_info, stacklevel + 1)  # + this frame
        return "(unknown file)", 0, "(unknown function)", None


def callerless_logger(name: str) -> logging.Logger:
    """The logger `name`, made to skip the caller lookup for each of its records.

    For a logger on a hot path of a process whose other loggers are not all ours (the API
    under gunicorn, where `configure` leaves the root alone): only this one changes.
    """
    logger = logging.getLogger(name)
    if type(logger) is logging.Logger:
        # A subclass with no state of its own: the logger keeps its handlers and level.
        logger.__class__ = _CallerlessLogger
    return logger


def configure(level: str = "INFO", fmt: str = "text", *, logger: str = "") -> BatchingHandler:
    """Send every record of `logger` (default: the root, i.e. all) to stderr at `level`.

    `fmt` is `text` or `json`. Replaces the handlers already on that logger, so calling it
    twice does not log twice. Returns the handler.

    For the root logger (a worker process, whose logging is all ours) records also skip
    what neither format shows (the Logging HOWTO's "Optimization" switches): thread and
    process names, and for loggers created from then on (`logging.setLoggerClass`) the
    caller's file and line.
    """
    if not logger:
        logging.setLoggerClass(_CallerlessLogger)
        logging.logThreads = False
        logging.logMultiprocessing = False
        if sys.version_info >= (3, 12):
            logging.logAsyncioTasks = False
    handler = make_handler(fmt)
    target = logging.getLogger(logger)
    for old in list(target.handlers):
        target.removeHandler(old)
        if isinstance(old, BatchingHandler):
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
    with _batches.lock:
        _batches.depth += 1
    try:
        yield
    finally:
        with _batches.lock:
            _batches.depth = max(_batches.depth - 1, 0)
            last = _batches.depth == 0
        if last:
            for handler in list(_HANDLERS):
                handler.write_held()


def write_due() -> None:
    """Write the held lines that have waited `MAX_HOLD_SECONDS` (cheap when nothing has)."""
    held_since = time.monotonic() - MAX_HOLD_SECONDS
    for handler in list(_HANDLERS):
        handler.write_held(older_than=held_since)


def flush() -> None:
    """Write held lines and flush every handler (before `os._exit`, which skips cleanup)."""
    for handler in {*logging.getLogger().handlers, *_HANDLERS}:
        handler.flush()
