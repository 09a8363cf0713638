"""The pass's log lines: one per task transition, with fields the JSON format writes as keys.

Never the payload, nor a handler's error message, which may quote it (a webhook URL, a
recipient): lines name the exception class, and the message is in the task's `last_error`.
Every module of the pass logs to `log`, one logger operators can filter by. A pass runs
inside `common.logging.batched()`, so its INFO lines cost one write per pass (or per
`common.logging.MAX_HOLD_SECONDS` for slow tasks), and below INFO a completed or released
task builds no fields.
"""

from __future__ import annotations

import logging
import traceback

from db import claims, workers

log = logging.getLogger("fairq.worker.processing")

# Messages of the task transition lines, %-formatted with `task_fields` (plus extras).
_TASK = "task %(task_id)s (company %(company_id)s, type %(type)s)"
MSG_COMPLETED = _TASK + " completed on attempt %(attempt)d in %(duration_ms).1f ms"
MSG_RETRIED = (
    _TASK + " attempt %(attempt)d/%(max_attempts)d failed after %(ran)s (%(error_type)s), "
    "retry in %(retry_in_s).1fs"
)
MSG_FAILED = (
    _TASK + " failed on attempt %(attempt)d/%(max_attempts)d after %(ran)s (%(error_type)s)"
)
MSG_WORKER_LOST = (
    _TASK + " failed: worker lost on each of %(attempt)d attempts (last holder %(locked_by)s)"
)
MSG_LEASE_EXPIRED = (
    _TASK + " attempt %(attempt)d: lease expired (holder %(locked_by)s stopped), requeued"
)
MSG_RELEASED = _TASK + " released unstarted, attempt %(attempt)d handed back"
MSG_LEASE_LOST = _TASK + " attempt %(attempt)d: lease lost, %(action)s changed nothing"
MSG_OVERRUN = (
    _TASK + " attempt %(attempt)d: handler still running %(duration_ms).0f ms after it started, "
    "%(grace_s)gs past its timeout of %(timeout_s)gs; timed out, its worker is to be replaced"
)


def task_fields(
    task: claims.ClaimedTask | workers.TakenBack, event: str, seconds: float | None, **more: object
) -> dict[str, object]:
    """The fields of a task transition's line; `duration_ms` is None when no handler ran.

    Passed both as `extra` (keys of the JSON line) and as the message's %-mapping, so each
    id is turned into text once per line.
    """
    return {
        "event": event,
        "task_id": str(task.id),
        "company_id": str(task.company_id),
        "type": task.type,
        "attempt": task.attempts,
        "duration_ms": None if seconds is None else round(seconds * 1000, 3),
        **more,
    }


def ran(seconds: float | None) -> str:
    """How long a handler ran, for a message: `12.3 ms`, or `no run`."""
    return "no run" if seconds is None else f"{seconds * 1000:.1f} ms"


def log_traceback(task: claims.ClaimedTask, exc: BaseException) -> None:
    """At DEBUG, where a handler's exception came from (helps with handler bugs)."""
    if log.isEnabledFor(logging.DEBUG):
        log.debug(
            "traceback of task %s:\n%s", task.id, code_traceback(exc),
            extra={"event": "task.traceback", "task_id": str(task.id)},
        )  # fmt: skip


def code_traceback(exc: BaseException) -> str:
    """Where `exc` and its causes were raised, without their messages (which may quote data)."""
    parts: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        frames = "".join(traceback.format_tb(current.__traceback__))
        parts.append(f"{frames}{type(current).__module__}.{type(current).__qualname__}")
        current = current.__cause__ or (
            None if current.__suppress_context__ else current.__context__
        )
    return "\n-- raised while handling --\n".join(parts)
